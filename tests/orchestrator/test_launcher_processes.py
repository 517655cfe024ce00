"""The launcher's child processes: logs, stopping (politely, then by force), dying with the launcher."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from primerl.launch.processes import ManagedProcess, child_environment, stop_all


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
    wait_for(lambda: "ready" in stubborn.tail())
    time.sleep(0.5)  # let the polite one reach its sleep
    started = time.monotonic()
    stop_all([polite, stubborn], grace_s=1.0)
    assert polite.poll() == 0 and "stopping cleanly" in polite.tail()
    assert stubborn.poll() == -signal.SIGKILL
    assert time.monotonic() - started < 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
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
    env = child_environment({"CUDA_VISIBLE_DEVICES": ""}, keep_primerl_vars=["PRIMERL_ADMIN_TOKEN"])
    assert "PRIMERL_SEED" not in env and env["PRIMERL_ADMIN_TOKEN"] == "secret"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PATH"] == os.environ["PATH"]
