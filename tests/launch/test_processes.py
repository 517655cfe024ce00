"""The launcher's child processes: logs, stopping (politely, then by force), dying with the launcher; the process
plan of `rl` for each device layout (commands and environments, without starting anything); torchrun's teardown."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from primerl.config import load, to_toml
from primerl.config.inference import InferenceConfig
from primerl.config.orchestrator import OrchestratorConfig
from primerl.config.rl import RLConfig
from primerl.config.trainer import TrainerConfig
from primerl.launch.local import build_processes, describe_devices
from primerl.launch.processes import ManagedProcess, child_environment, stop_all, torchrun_command
from primerl.multicast import MULTICAST_OFF


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_output_goes_to_the_log_and_the_tail_shows_the_end(tmp_path):
    p = ManagedProcess("noisy", python("for i in range(100): print('line', i)"), tmp_path / "logs" / "noisy.log")
    p.start()
    p.popen.wait()
    assert p.poll() == 0
    tail = p.tail(3).splitlines()
    assert tail == ["line 97", "line 98", "line 99"]


def test_stop_sends_sigint_first_and_kills_what_ignores_it(tmp_path):
    polite = ManagedProcess("polite", python("""
        import time
        try:
            print("ready", flush=True)  # from here on, SIGINT lands in the handler below
            time.sleep(60)
        except KeyboardInterrupt:
            print("stopping cleanly", flush=True)
    """), tmp_path / "polite.log")
    stubborn = ManagedProcess("stubborn", python("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """), tmp_path / "stubborn.log")
    for p in (polite, stubborn):
        p.start()
    # the log's first line echoes the command (which contains the word): wait for a line that is only the word
    wait_for(lambda: all("ready" in p.tail().splitlines() for p in (polite, stubborn)), timeout=120)
    stop_all([polite, stubborn], grace_s=10.0)  # the polite one exits at once; the stubborn one waits it out
    assert polite.poll() == 0 and "stopping cleanly" in polite.tail()
    assert stubborn.poll() == -signal.SIGKILL


def test_children_of_a_launcher_that_ignores_sigint_still_stop_on_it(tmp_path):
    """`rl ... &` in a script starts the launcher with SIGINT ignored; its children must not inherit that, or every
    stop would wait out the grace period and kill them."""
    child = ManagedProcess("child", python("""
        import time
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("stopping cleanly", flush=True)
    """), tmp_path / "child.log")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_for(lambda: "ready" in child.tail().splitlines(), timeout=120)
    stop_all([child], grace_s=30.0)
    assert child.poll() == 0 and "stopping cleanly" in child.tail()


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (ended, not yet reaped by whoever adopted it) is not alive."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_stopped_torchrun_worker_in_a_session_of_its_own_is_killed_with_its_agent(tmp_path):
    """torchrun starts each worker in a session of its own, out of reach of a signal to the agent's group. A worker
    that hangs (here SIGSTOPped: it holds its sockets and answers no signal but SIGKILL) outlives the grace the
    agent's own stop gives it (30 s), so the launcher kills the agent's group after its grace, and must kill the
    worker too: an orphan would keep its memory, GPU and ports."""
    script = tmp_path / "worker.py"
    script.write_text(f"import os, time\nopen({str(tmp_path / 'worker.pid')!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(300)\n")
    agent = ManagedProcess("trainer", torchrun_command(1, [str(script)]), tmp_path / "trainer.log")
    agent.start()
    try:
        wait_for(lambda: (tmp_path / "worker.pid").is_file() and (tmp_path / "worker.pid").read_text(), timeout=120)
        worker = int((tmp_path / "worker.pid").read_text())
        assert os.getsid(worker) != os.getsid(agent.pid)  # what makes it out of reach of the group's signals
        os.kill(worker, signal.SIGSTOP)
        stop_all([agent], grace_s=2.0)
        assert agent.poll() is not None
        wait_for(lambda: not _alive(worker), timeout=30)
    finally:
        if (tmp_path / "worker.pid").is_file() and _alive(pid := int((tmp_path / "worker.pid").read_text())):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_a_second_sigterm_does_not_cut_the_stop_short():
    """A launcher's first SIGTERM starts its orderly stop; a second one, sent while it stops, is noted and ignored:
    the stop finishes and no traceback is printed."""
    launcher = subprocess.Popen(python("""
        import signal, sys, time
        from primerl.launch.processes import Terminated, raise_terminated
        signal.signal(signal.SIGTERM, raise_terminated)
        try:
            print("running", flush=True)
            time.sleep(60)
        except Terminated:
            print("stopping", flush=True)
            sys.stdin.readline()  # the stop lasts until the test has sent its second SIGTERM
            print("stopped", flush=True)
    """), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.stdout.readline().strip() == "running"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.stdout.readline().strip() == "stopping"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.stdout.readline().strip() == "stopping already; SIGKILL ends it at once"
    finally:
        rest, _ = launcher.communicate("go on\n", timeout=20)
    assert rest.strip() == "stopped" and launcher.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and SIGTERM")
def test_a_sigterm_during_the_preload_stops_the_launch(tmp_path):
    """The preload (imports, before the server and the trainer are forked) falls back to fresh interpreters when it
    fails; a SIGTERM arriving meanwhile is not such a failure. It once was taken for one: the launcher started every
    process anyway and the run went on to its last step with the process that started it gone."""
    launcher = subprocess.Popen(python(f"""
        import signal, sys
        from pathlib import Path
        from primerl.launch.local import start_processes
        from primerl.launch.processes import ManagedProcess, Terminated, raise_terminated
        signal.signal(signal.SIGTERM, raise_terminated)
        child = ManagedProcess("server", [sys.executable, "-c", "import time; time.sleep(60)"],
                               Path({str(tmp_path / "server.log")!r}), fork=True)
        assert "torch" not in sys.modules  # so the preload has torch to import: seconds, for the SIGTERM to land in
        print("preloading", flush=True)
        try:
            start_processes([child], sys.stdout)
            print("started", flush=True)
        except Terminated:
            print("stopped", flush=True)
        finally:
            if child.popen is not None:
                child.popen.kill()
    """), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.stdout.readline().strip() == "preloading"
        time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
    finally:
        rest, _ = launcher.communicate(timeout=120)
    assert rest.strip().splitlines()[-1:] == ["stopped"], rest
    assert "preloading failed" not in rest
    assert not (tmp_path / "server.log").exists()  # nothing was started


def test_children_die_with_a_killed_launcher(tmp_path):
    pid_file = tmp_path / "child.pid"
    launcher = subprocess.Popen(python(f"""
        import time
        from pathlib import Path
        from primerl.launch.processes import ManagedProcess
        p = ManagedProcess("sleeper", ["sleep", "60"], Path({str(tmp_path / "sleeper.log")!r}))
        p.start()
        Path({str(pid_file)!r}).write_text(str(p.pid))
        time.sleep(60)
    """))
    wait_for(lambda: pid_file.exists() and pid_file.read_text())
    child = int(pid_file.read_text())
    launcher.kill()
    launcher.wait()
    wait_for(lambda: not _alive(child))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_children_get_no_primerl_variables_except_those_kept(monkeypatch):
    monkeypatch.setenv("PRIMERL_SEED", "3")
    monkeypatch.setenv("PRIMERL_ADMIN_TOKEN", "secret")
    monkeypatch.setenv("PRIMERL_MODEL_DIRS", "/opt/models")  # not a config key: where prepared models are
    env = child_environment({"CUDA_VISIBLE_DEVICES": ""}, keep_primerl_vars=["PRIMERL_ADMIN_TOKEN"])
    assert "PRIMERL_SEED" not in env and env["PRIMERL_ADMIN_TOKEN"] == "secret"
    assert env["PRIMERL_MODEL_DIRS"] == "/opt/models"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PATH"] == os.environ["PATH"]


def test_children_wait_passively_in_openmp_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert child_environment()["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert child_environment()["OMP_WAIT_POLICY"] == "ACTIVE"


# ---------------------------------------------------------------------------------------------------------------------
# The process plan of `rl` for a device layout: commands and environments, nothing started


def plan(tmp_path, num_gpus: int, *overrides: str, gpus: list[str] | None = None) -> dict[str, ManagedProcess]:
    cfg, _ = load(RLConfig, ["--model.name=tiny", f"--output_dir={tmp_path / 'run'}", *overrides])
    gpus = gpus if gpus is not None else [str(i) for i in range(num_gpus)]
    processes = build_processes(cfg, tmp_path / "run", cfg.assign_devices(num_gpus), gpus)
    return {p.name: p for p in processes}


@pytest.mark.parametrize(
    ("num_gpus", "inference_gpus", "trainer_gpus"),
    [(0, "", ""), (1, "0", "0"), (2, "0", "1"), (4, "0", "1,2,3"), (8, "0", "1,2,3,4,5,6,7")],
)
def test_each_process_gets_its_gpus_and_the_trainer_one_rank_per_gpu(tmp_path, num_gpus, inference_gpus, trainer_gpus):
    processes = plan(tmp_path, num_gpus)
    assert processes["inference"].env["CUDA_VISIBLE_DEVICES"] == inference_gpus
    assert processes["trainer"].env["CUDA_VISIBLE_DEVICES"] == trainer_gpus
    assert processes["orchestrator"].env["CUDA_VISIBLE_DEVICES"] == ""
    ranks = len(trainer_gpus.split(",")) if trainer_gpus else 1
    trainer_config = str(tmp_path / "run" / "config" / "trainer.toml")
    argv = list(processes["trainer"].argv)
    if ranks == 1:
        assert argv == [sys.executable, "-m", "primerl.cli", "trainer", "@", trainer_config]
    else:
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert "--standalone" in argv and f"--nproc-per-node={ranks}" in argv and "--max-restarts=0" in argv
        assert argv[argv.index("-m", 3):] == ["-m", "primerl.cli", "trainer", "@", trainer_config]
    orchestrator, _ = load(OrchestratorConfig, ["@", str(tmp_path / "run" / "config" / "orchestrator.toml")])
    assert orchestrator.batch.num_ranks == ranks
    for p in processes.values():
        assert {k: p.env[k] for k in MULTICAST_OFF} == MULTICAST_OFF
    assert processes["inference"].env["PRIMERL_ADMIN_TOKEN"] == processes["orchestrator"].env["PRIMERL_ADMIN_TOKEN"]
    assert "PRIMERL_ADMIN_TOKEN" not in processes["trainer"].env


@pytest.mark.parametrize("num_gpus", [0, 2])
def test_a_teacher_is_a_second_server_on_the_inference_devices_that_the_orchestrator_is_told_of(tmp_path, num_gpus):
    processes = plan(tmp_path, num_gpus, "--orchestrator.advantage.type=distill", "--teacher.model.name=tiny",
                     "--teacher.served_model_name=teacher")
    assert list(processes) == ["inference", "orchestrator", "trainer", "teacher"]
    teacher = processes["teacher"]
    assert list(teacher.argv)[-3:] == ["inference", "@", str(tmp_path / "run" / "config" / "teacher.toml")]
    assert teacher.env["CUDA_VISIBLE_DEVICES"] == processes["inference"].env["CUDA_VISIBLE_DEVICES"]
    served, _ = load(InferenceConfig, ["@", str(tmp_path / "run" / "config" / "teacher.toml")])
    orchestrator, _ = load(OrchestratorConfig, ["@", str(tmp_path / "run" / "config" / "orchestrator.toml")])
    assert orchestrator.teacher.base_url == f"http://127.0.0.1:{served.port}" and served.port > 0
    assert orchestrator.teacher.model == "teacher" and served.served_model_name == "teacher"
    assert "teacher" not in plan(tmp_path / "plain", num_gpus)


def test_the_trainer_warms_up_on_rows_of_seq_len_before_its_first_batch_unless_vllm_shares_its_gpu(tmp_path):
    def trainer_config(where):
        return load(TrainerConfig, ["@", str(where / "run" / "config" / "trainer.toml")])[0]

    plan(tmp_path / "cpu", 0, "--seq_len=320")
    assert trainer_config(tmp_path / "cpu").train.warm_up_tokens == 320
    plan(tmp_path / "set", 0, "--seq_len=320", "--trainer.train.warm_up_tokens=0")
    assert trainer_config(tmp_path / "set").train.warm_up_tokens == 0  # the user's setting stands
    plan(tmp_path / "gpus", 2, "--seq_len=320")
    assert trainer_config(tmp_path / "gpus").train.warm_up_tokens == 320
    plan(tmp_path / "shared", 1, "--seq_len=320")  # the embedded engine on the trainer's GPU: it grows as it needs
    assert trainer_config(tmp_path / "shared").train.warm_up_tokens == 320
    plan(tmp_path / "vllm", 2, "--seq_len=320", "--inference.engine=vllm")  # vLLM on a GPU of its own
    assert trainer_config(tmp_path / "vllm").train.warm_up_tokens == 320
    plan(tmp_path / "beside", 1, "--seq_len=320", "--inference.engine=vllm")  # vLLM's start measures the free memory
    assert trainer_config(tmp_path / "beside").train.warm_up_tokens == 0
    # a recipe's stage reaches `rl` as a config file written by to_toml: the unset value must stay unset there
    written, _ = load(RLConfig, ["--model.name=tiny", "--seq_len=320", f"--output_dir={tmp_path / 'file' / 'run'}"])
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "rl.toml").write_text(to_toml(written))
    cfg, _ = load(RLConfig, ["@", str(tmp_path / "file" / "rl.toml")])
    build_processes(cfg, tmp_path / "file" / "run", cfg.assign_devices(0), [])
    assert trainer_config(tmp_path / "file").train.warm_up_tokens == 320


def test_gpus_are_named_as_in_the_launchers_cuda_visible_devices(tmp_path):
    processes = plan(tmp_path, 4, "--devices.trainer=[1, 3]", gpus=["4", "5", "6", "7"])
    assert processes["inference"].env["CUDA_VISIBLE_DEVICES"] == "4"
    assert processes["trainer"].env["CUDA_VISIBLE_DEVICES"] == "5,7"


def test_vllm_tensor_parallel_size_follows_the_inference_gpus(tmp_path):
    plan(tmp_path, 8, "--inference.engine=vllm", "--devices.inference=[0, 1, 2, 3]", "--weight_transfer=broadcast")
    inference, _ = load(InferenceConfig, ["@", str(tmp_path / "run" / "config" / "inference.toml")])
    trainer, _ = load(TrainerConfig, ["@", str(tmp_path / "run" / "config" / "trainer.toml")])
    assert inference.vllm.tensor_parallel_size == 4
    assert trainer.weights.broadcast.receivers == 4  # one per vLLM worker, so the trainer waits for all of them


def test_multicast_settings_of_the_user_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    processes = plan(tmp_path, 2)
    assert processes["trainer"].env["NCCL_NVLS_ENABLE"] == "1"
    assert processes["trainer"].env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


@pytest.mark.parametrize(
    ("num_gpus", "overrides", "line"),
    [
        (0, [], "devices: inference CPU | trainer CPU, 1 rank | orchestrator CPU"),
        (1, [], "devices: inference GPU 0 | trainer GPU 0 (shared with inference), 1 rank | orchestrator CPU"),
        (4, [], "devices: inference GPU 0 | trainer GPUs 1,2,3, 3 ranks under torchrun | orchestrator CPU"),
        (8, ["--inference.engine=vllm", "--inference.vllm.tensor_parallel_size=2", "--devices.trainer=[2, 3]"],
         ("devices: inference GPUs 0,1 (vLLM tensor parallel 2) | trainer GPUs 2,3, 2 ranks under torchrun | "
          "orchestrator CPU | unused GPUs 4,5,6,7")),
    ],
)
def test_the_console_says_which_gpus_each_process_got(num_gpus, overrides, line):
    cfg, _ = load(RLConfig, overrides)
    gpus = [str(i) for i in range(num_gpus)]
    assert describe_devices(cfg.assign_devices(num_gpus), gpus, cfg.inference.engine) == line


# ---------------------------------------------------------------------------------------------------------------------
# torchrun as the launcher starts it (no torch in the ranks: they only need to be processes)

RANK_SCRIPT = """
    import os, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    (out / f"rank_{rank}.pid").write_text(str(os.getpid()))
    if rank == "1":
        while not (out / "rank_0.pid").exists():
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(600)  # rank 0 would wait here for a long time
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_failing_rank_stops_torchrun_and_the_other_ranks(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    trainer = ManagedProcess("trainer", torchrun_command(2, [str(script), str(tmp_path)]), tmp_path / "trainer.log",
                             child_environment())
    trainer.start()
    try:
        code = trainer.popen.wait(timeout=120)
    finally:
        stop_all([trainer], grace_s=1.0)
    assert code != 0, trainer.tail()
    survivor = int((tmp_path / "rank_0.pid").read_text())
    wait_for(lambda: not _alive(survivor))


PAIR_SCRIPT = """
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    Path(sys.argv[1], f"sum_{dist.get_rank()}").write_text(f"{dist.get_world_size()} {int(total)}")
    dist.destroy_process_group()
"""


@pytest.mark.integration
def test_two_torchrun_groups_on_one_host_do_not_meet(tmp_path):
    script = tmp_path / "pair.py"
    script.write_text(textwrap.dedent(PAIR_SCRIPT))
    env = {**child_environment(), "OMP_NUM_THREADS": "1"}
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        runs.append(ManagedProcess(name, torchrun_command(2, [str(script), str(tmp_path / name)]),
                                   tmp_path / f"{name}.log", env))
    for run in runs:
        run.start()
    try:
        codes = [run.popen.wait(timeout=300) for run in runs]
    finally:
        stop_all(runs, grace_s=1.0)
    assert codes == [0, 0], [run.tail() for run in runs]
    for name in ("a", "b"):  # each group is its own two ranks: world size 2, sum 1 + 2
        assert [f.read_text() for f in sorted((tmp_path / name).glob("sum_*"))] == ["2 3", "2 3"]


# ---------------------------------------------------------------------------------------------------------------------
# Children forked from a preloaded launcher (`rl.preload`, CPU-only runs)


def test_the_cpu_plan_forks_the_server_and_the_trainer_and_no_other_plan_does(tmp_path):
    cpu = plan(tmp_path / "cpu", 0)
    assert {name: p.fork for name, p in cpu.items()} == {"inference": True, "orchestrator": False, "trainer": True}
    for where, num_gpus, overrides in (("gpu", 1, ()), ("gpus", 4, ()), ("off", 0, ("--preload=false",))):
        assert not any(p.fork for p in plan(tmp_path / where, num_gpus, *overrides).values()), where


def _forking_launcher(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh launcher process (the test process itself is never forked)."""
    script = textwrap.dedent("""
        import json, os, sys, time
        from pathlib import Path
        from primerl.launch.processes import ManagedProcess, child_environment, preload, primerl_command, stop_all
        tmp = Path(sys.argv[1])
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          check=False)


def test_a_forked_command_gets_its_environment_log_exit_code_and_session(tmp_path):
    done = _forking_launcher(tmp_path, """
        preload(["primerl.models"])
        env = child_environment({"PRIMERL_CACHE": str(tmp / "cache")})
        assert "PRIMERL_CACHE" not in os.environ
        listed = ManagedProcess("list", primerl_command("models", "list"), tmp / "list.log", env, fork=True)
        bad = ManagedProcess("bad", primerl_command("models", "bogus"), tmp / "bad.log", env, fork=True)
        for p in (listed, bad):
            p.start()
        sessions = {p.name: os.getsid(p.pid) == p.pid for p in (listed, bad) if p.poll() is None}
        print(json.dumps({"codes": [listed.popen.wait(), bad.popen.wait()], "sessions": sessions}))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["codes"] == [0, 2]  # argparse's usage error, as from a new interpreter
    assert all(result["sessions"].values())
    listed = (tmp_path / "list.log").read_text()
    assert "(forked, preloaded)" in listed.splitlines()[0]
    assert f"cache: {tmp_path / 'cache' / 'models'}" in listed  # the child's environment, not the launcher's
    assert "tiny" in listed
    assert "invalid choice: 'bogus'" in (tmp_path / "bad.log").read_text()


def test_a_forked_server_stops_cleanly_on_sigint_and_dies_with_a_killed_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from primerl.launch.processes import ManagedProcess, child_environment, preload, primerl_command, stop_all
        from primerl.ports import free_port
        tmp = Path({str(tmp_path)!r})
        preload(["primerl.inference.server"])
        servers = []
        for name in ("stopped", "orphaned"):
            port = free_port()
            p = ManagedProcess(name, primerl_command("inference", "--model.name=tiny", "--threads=1", f"--port={{port}}"),
                               tmp / f"{{name}}.log", child_environment(), fork=True)
            p.start()
            servers.append((p, port))
        import httpx
        for p, port in servers:
            deadline = time.monotonic() + 300
            while True:
                assert p.poll() is None and time.monotonic() < deadline, p.tail()
                try:
                    if httpx.get(f"http://127.0.0.1:{{port}}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
        stopped, orphaned = servers[0][0], servers[1][0]
        (tmp / "titles.json").write_text(json.dumps({{
            p.name: [Path(f"/proc/{{p.pid}}/cmdline").read_bytes().decode(), Path(f"/proc/{{p.pid}}/comm").read_text()]
            for p, _ in servers}}))
        stop_all([stopped], grace_s=60)
        (tmp / "stopped.code").write_text(str(stopped.poll()))
        (tmp / "orphan.pid").write_text(str(orphaned.pid))
        time.sleep(600)
    """)])
    try:
        wait_for(lambda: (tmp_path / "orphan.pid").exists() and (tmp_path / "orphan.pid").read_text(), timeout=600)
    finally:
        if not (tmp_path / "orphan.pid").exists():
            launcher.kill()
    assert (tmp_path / "stopped.code").read_text() == "0", (tmp_path / "stopped.log").read_text()[-3000:]
    assert "Traceback" not in (tmp_path / "stopped.log").read_text()
    for cmdline, comm in json.loads((tmp_path / "titles.json").read_text()).values():
        # `ps` shows the command the child runs, not the launcher's (whose line it inherited)
        assert cmdline.rstrip("\0").split("\0")[:2] == ["primerl", "inference"] and "--model.name=tiny" in cmdline
        assert comm.strip() == "pl-inference"
    orphan = int((tmp_path / "orphan.pid").read_text())
    assert _alive(orphan)
    launcher.kill()
    launcher.wait()
    wait_for(lambda: not _alive(orphan), timeout=60)


def test_a_launcher_that_had_torch_loaded_before_starts_its_children_fresh(tmp_path):
    """It may have run OpenMP work (a model converted on first use), whose threads a fork would not carry."""
    done = _forking_launcher(tmp_path, """
        import torch
        torch.ones(64, 64) @ torch.ones(64, 64)
        from primerl.launch.local import start_processes
        p = ManagedProcess("list", primerl_command("models", "list"), tmp / "list.log", child_environment(), fork=True)
        start_processes([p], sys.stdout)
        print(json.dumps({"code": p.popen.wait(), "fork": p.fork}))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "fork": False}
    assert "forked" not in (tmp_path / "list.log").read_text().splitlines()[0]
