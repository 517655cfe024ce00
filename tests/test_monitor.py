import json
import multiprocessing as mp

from primerl.monitor import MetricsLogger, format_line, main, read_metrics


def _writer(run_dir, source, n):
    logger = MetricsLogger(run_dir, source)
    for step in range(n):
        logger.log(step, {"loss": step * 0.5, "text": "x" * 200})


def test_concurrent_writers_never_interleave(tmp_path):
    procs = [mp.Process(target=_writer, args=(tmp_path, f"p{i}", 200)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 600
    for line in lines:
        json.loads(line)
    assert len(read_metrics(tmp_path, "p1")) == 200


def test_non_finite_values_become_null_and_torn_lines_are_skipped(tmp_path):
    MetricsLogger(tmp_path, "trainer").log(1, {"loss": float("nan"), "lr": 1e-5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "sour')
    records = read_metrics(tmp_path)
    assert records == [{"step": 1, "source": "trainer", "time": records[0]["time"], "loss": None, "lr": 1e-5}]


def test_format_line():
    line = format_line(3, {"loss": 0.123456, "lr": 1e-5, "tokens": 12345, "missing": None}, ["loss", "lr", "tokens"])
    assert line == "step 3 | loss 0.1235 | lr 1.00e-05 | tokens 12,345"


def test_plot_writes_pngs(tmp_path, capsys):
    orch, trainer = MetricsLogger(tmp_path, "orchestrator"), MetricsLogger(tmp_path, "trainer")
    for step in range(5):
        orch.log(step, {"reward_mean": step / 5})
        trainer.log(step, {"loss": 1 / (step + 1), "tokens_per_s": 100.0 + step})
    assert main([str(tmp_path)]) == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["loss.png", "reward.png", "throughput.png"]
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_is_an_error(tmp_path, capsys):
    assert main([str(tmp_path / "runs" / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl in" in err and "give the run directory" in err


def _run_with_rewards(run_dir):
    MetricsLogger(run_dir, "orchestrator").log(1, {"reward_mean": 0.5})
    return run_dir / "plots" / "reward.png"


def test_plot_takes_the_run_directory_or_a_stage_directory_in_it(tmp_path, capsys):
    recipe_run = tmp_path / "reverse-text"  # a recipe run: its rl stage writes into the run directory itself
    png = _run_with_rewards(recipe_run)
    assert main([str(recipe_run / "rl")]) == 0  # what the README used to say
    assert capsys.readouterr().out.splitlines() == [str(png)]
    assert main([str(recipe_run / "logs")]) == 0


def test_plot_of_a_run_split_by_stage_draws_every_stage(tmp_path, capsys):
    run = tmp_path / "demo"  # the demo by hand: runs/reverse-text/{sft,rl}
    pngs = [_run_with_rewards(run / "rl"), _run_with_rewards(run / "sft")]
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(p) for p in pngs]


def _wandb_writer(run_dir, source, records):
    from primerl.config.common import WandbConfig

    logger = MetricsLogger(run_dir, source, wandb=WandbConfig(project="primerl-tests", mode="offline"))
    assert logger._wandb.config["recipe"] == {"name": "tiny"}  # the manifest, not the (empty) fallback config
    for step, metrics in records:
        logger.log(step, metrics)
    logger.close()


def test_processes_of_one_run_dir_log_to_one_wandb_run(tmp_path, monkeypatch):
    """Two processes of one run directory (as the trainer and orchestrator of an rl run) share one W&B run and its
    config (the manifest when the run has one); the offline files hold every step of each, on its own step axis."""
    from primerl.wandb_run import RUN_ID_FILE, offline_history

    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": {"name": "tiny"}}))
    writers = [
        mp.Process(target=_wandb_writer, args=(tmp_path, "orchestrator", [(s, {"reward_mean": s / 4}) for s in range(3)])),
        mp.Process(target=_wandb_writer, args=(
            tmp_path, "trainer", [(s + 1, {"loss": s * 0.5, "lr": 1e-4, "note": "not a metric"}) for s in range(3)]
        )),
    ]
    for p in writers:
        p.start()
    for p in writers:
        p.join()
    assert [p.exitcode for p in writers] == [0, 0]
    history = offline_history(tmp_path)
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert list(history) == [run_id]
    rows = history[run_id]
    assert [(r["trainer/step"], r["trainer/loss"]) for r in rows if "trainer/step" in r] == [(1, 0.0), (2, 0.5),
                                                                                             (3, 1.0)]
    assert [r["orchestrator/reward_mean"] for r in rows if "orchestrator/step" in r] == [0.0, 0.25, 0.5]
    assert not any("trainer/note" in r for r in rows)


def test_wandb_is_off_without_a_project(tmp_path):
    from primerl.config.common import WandbConfig

    logger = MetricsLogger(tmp_path, "trainer", wandb=WandbConfig(mode="offline"))
    logger.log(1, {"loss": 1.0})
    assert logger._wandb is None and not (tmp_path / "wandb").exists()


def test_the_throughput_plot_draws_per_step_values_and_every_axis_is_labelled(tmp_path):
    from primerl.monitor import PLOTS, plot_data

    orch, trainer = MetricsLogger(tmp_path, "orchestrator"), MetricsLogger(tmp_path, "trainer")
    for step in range(1, 4):  # replies shrink: per step the orchestrator gets faster, its cumulative average lags
        orch.log(step, {"reward_mean": 0.1, "tokens_per_s": 50.0 + step, "step_tokens_per_s": 100.0 * step})
        trainer.log(step, {"loss": 1.0, "tokens_per_s": 200.0})
    _, ylabel, lines = plot_data(read_metrics(tmp_path))["throughput.png"]
    assert dict(lines) == {"trainer/tokens_per_s": [(1, 200.0), (2, 200.0), (3, 200.0)],
                           "orchestrator/step_tokens_per_s": [(1, 100.0), (2, 200.0), (3, 300.0)]}
    assert "per step" in ylabel
    assert all(ylabel for _, _, ylabel, _ in PLOTS)
