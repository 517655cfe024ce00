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
    assert main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
