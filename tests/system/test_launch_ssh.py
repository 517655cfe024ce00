"""`primerl launch ssh` against real hosts: network namespaces on this machine, each with its own sshd, the run
directory on the filesystem they share. The launcher itself runs in a namespace of its own (the user's machine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w
from conftest import CHECKLIST_SKIP, RECIPE, launch_with_fault
from ssh_drills import target_pid, write_deploy

from primerl.launch.restart import restarts_of_run
from primerl.monitor import read_metrics
from primerl.recipes.manifest import read_manifest

pytestmark = pytest.mark.launchers


def launch(cluster, deploy: Path, *overrides: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    command = cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE),
                                       "--deploy", str(deploy), "--rl.max_steps=2", *overrides)
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s)
    print(done.stdout[-6000:], done.stderr[-3000:])
    return done


def assert_nothing_left(cluster, run_dir: Path) -> None:
    for name in cluster.hosts:
        assert cluster.stray_processes(name) == set(), f"processes left running on host {name}"


def trained_steps(run_dir: Path) -> list[int]:
    return sorted(int(r["step"]) for r in read_metrics(run_dir, "trainer"))


def test_down_host_and_refused_key_named_in_preflight_nothing_started(cluster, tmp_path):
    run_dir = tmp_path / "run"
    hosts = {
        "a": {"address": cluster.hosts["a"].address, "user": "root", "identity_file": str(cluster.key)},
        "down": {"address": cluster.unused_address, "user": "root", "identity_file": str(cluster.key)},
        "nokey": {"address": cluster.hosts["b"].address, "user": "root", "identity_file": str(cluster.other_key)},
    }
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["down", "nokey"]}
    done = launch(cluster, write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles, hosts))
    out = done.stdout
    assert done.returncode == 1
    assert f"down: connect failed: host down ({cluster.unused_address}:22): " in out
    assert f"nokey: connect failed: host nokey ({cluster.hosts['b'].address}:22): refused the login of root" in out
    assert "Errno" not in out and "Traceback" not in done.stderr
    assert "preflight failed on host(s) down (connect); nokey (connect); nothing was started" in out
    assert "starting" not in out and not (run_dir / "logs").exists() and not (run_dir / "config").exists()
    assert_nothing_left(cluster, run_dir)


def test_unknown_host_keys_are_refused_unless_accepted_then_recorded_and_verified(cluster, tmp_path):
    """A known_hosts file without the hosts' keys: refused, named with the fingerprint and the flag; with
    --accept-new-host-keys each key is logged and recorded; the next launch verifies them. The run directory already
    holds a run, so every launch stops right after connecting."""
    from netns_hosts import host_key_fingerprint

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    known = tmp_path / "known_hosts"
    known.write_text("")
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}
    deploy = write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles, known_hosts=str(known))
    print_ = host_key_fingerprint(cluster.host_key)
    refused = launch(cluster, deploy)
    assert refused.returncode == 1
    for name in ("a", "b"):
        assert (f"{name}: connect failed: host {name} ({cluster.hosts[name].address}:22): unknown host key "
                f"ssh-ed25519 {print_}: not in ") in refused.stdout
    assert "--accept-new-host-keys" in refused.stdout and known.read_text() == ""
    accepted = launch(cluster, deploy, "--accept-new-host-keys")
    assert accepted.returncode == 1 and "already holds a run" in accepted.stdout
    for name in ("a", "b"):
        assert (f"launch: host {name} ({cluster.hosts[name].address}:22): accepted the new host key ssh-ed25519 "
                f"{print_} and recorded it in {known}") in accepted.stdout
    assert sorted(known.read_text().splitlines()) == sorted(cluster.known_hosts.read_text().splitlines())
    verified = launch(cluster, deploy)
    assert verified.returncode == 1 and "connect failed" not in verified.stdout
    assert "accepted" not in verified.stdout and "already holds a run" in verified.stdout
    assert_nothing_left(cluster, run_dir)


def test_checklist_failure_on_one_host_starts_nothing(cluster, tmp_path, tiny_model_dir):
    # host b's model cache holds a corrupted copy of the tiny model: its checklist's model step must fail
    cache_b = tmp_path / "cache-b"
    shutil.copytree(tiny_model_dir, cache_b / "models" / tiny_model_dir.name)
    weights = cache_b / "models" / tiny_model_dir.name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    deploy = write_deploy(tmp_path / "deploy.toml", cluster, run_dir,
                          {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]})
    extra = {"deploy": {"hosts": {"b": {"env": {"PRIMERL_CACHE": str(cache_b)}}}}}
    (tmp_path / "cache-b.toml").write_text(tomli_w.dumps(extra))
    done = launch(cluster, deploy, "--deploy", str(tmp_path / "cache-b.toml"))
    assert done.returncode == 1
    table = done.stdout[done.stdout.index("host "):]
    assert "b: model failed:" in table and "a: model failed" not in table
    assert "preflight failed on host(s) b (model); nothing was started" in done.stdout
    assert json.loads((run_dir / "checklist" / "a.json").read_text())["ok"] is True
    assert not (run_dir / "logs").exists() and not (run_dir / "metrics.jsonl").exists()
    assert_nothing_left(cluster, run_dir)


def test_trainer_on_one_host_inference_and_orchestrator_on_another_after_the_full_checklist(cluster, tmp_path):
    """A new user's first launch: the whole checklist (the heavy steps and the smoke run included) on both hosts at
    once, each in its own `logs/checklist/<host>/` of the shared run directory, then the run."""
    run_dir = tmp_path / "run"
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}
    done = launch(cluster, write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles, checklist_skip=[]))
    assert done.returncode == 0, done.stdout[-3000:]
    for host in ("a", "b"):
        report = json.loads((run_dir / "checklist" / f"{host}.json").read_text())
        statuses = {s["name"]: s["status"] for s in report["steps"]}
        assert report["ok"] and report["log_dir"] == str(run_dir / "logs" / "checklist" / host)
        for step in ("rl_trainer", "inference", "rl_smoke"):
            assert statuses[step] == "passed", (host, step, report)
        logs = run_dir / "logs" / "checklist" / host
        assert {"rl_smoke.toml", "rl_smoke.log", "inference.toml", "inference.log", "rl_trainer.log"} <= \
            {p.name for p in logs.iterdir()}
        assert (logs / "rl_smoke.log").read_text().count("rl: run ") == 1  # one smoke run per log, never mixed
    assert not [p for p in (run_dir / "logs" / "checklist").iterdir() if p.is_file()]
    assert "launch: done, 2 steps" in done.stdout
    assert "[trainer.0@b]" in done.stdout and "[inference.0@a]" in done.stdout
    assert trained_steps(run_dir) == [1, 2]
    assert (run_dir / "weights" / "step_2").is_dir()
    record = json.loads((run_dir / "launch" / "plan.json").read_text())
    assert [p["label"] for p in record["processes"]] == ["inference.0@a", "orchestrator@a", "trainer.0@b"]
    assert record["checklist"]["b"]["model"] == "passed" and record["hosts"]["b"] == cluster.hosts["b"].address
    assert_nothing_left(cluster, run_dir)


def test_trainer_split_over_two_hosts_and_two_inference_servers_serve_one_run(cluster, tmp_path):
    """Each host runs one inference server and one trainer node (torchrun, 2 nodes x 1 rank, gloo); the orchestrator
    on a spreads its requests over both servers and loads every weight version into both. Three steps: with
    max_async_steps = 1 the third batch is the first that needs new weights (step 1's) in the servers."""
    run_dir = tmp_path / "run"
    roles = {"inference": ["a", "b"], "orchestrator": "a", "trainer": ["a", "b"]}
    done = launch(cluster, write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles), "--rl.max_steps=3")
    assert done.returncode == 0, done.stdout[-3000:]
    assert trained_steps(run_dir) == [1, 2, 3]
    for node in ("trainer.0@a", "trainer.1@b"):
        log = (run_dir / "logs" / f"{node}.log").read_text()
        assert "--nnodes=2" in log.splitlines()[0]
    orchestrator = tomllib.loads((run_dir / "config" / "orchestrator.toml").read_text())
    assert orchestrator["batch"]["num_ranks"] == 2  # batches were split for the two ranks
    assert orchestrator["client"]["base_urls"] == [f"http://{cluster.hosts[h].address}:8000" for h in ("a", "b")]
    for server in ("inference.0@a", "inference.1@b"):
        log = (run_dir / "logs" / f"{server}.log").read_text()
        assert re.search(r"(generate|chat\S*) \S+ n=\d+ ", log), f"{server} served no request"
        # the third batch needs policy version >= 1; the orchestrator loads the newest published, 1 or 2
        assert re.search(r"as policy version [12] ", log), f"{server} never got new weights"
    assert_nothing_left(cluster, run_dir)


def test_a_process_failing_at_every_start_stops_every_host_after_the_restarts_and_is_named(cluster, tmp_path):
    """Host b's model cache is not a directory: its trainer dies at every start (the model and memory_fit steps, which
    would catch it, are skipped). The launcher stops the processes on host a too, restarts the run once
    (`--max-restarts 1`), then stops for good and names the role, the host and why there is no other restart."""
    run_dir = tmp_path / "run"
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}
    deploy = write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles,
                          checklist_skip=[*CHECKLIST_SKIP, "model", "memory_fit"])
    (tmp_path / "not-a-dir").write_text("")
    extra = {"deploy": {"hosts": {"b": {"env": {"PRIMERL_CACHE": str(tmp_path / "not-a-dir")}}}}}
    (tmp_path / "broken-b.toml").write_text(tomli_w.dumps(extra))
    done = launch(cluster, deploy, "--deploy", str(tmp_path / "broken-b.toml"), "--max-restarts=1")
    assert done.returncode == 1
    assert "launch: restart 1/1: trainer.0 on host b exited with code 1 at step 0; starting again from the initial " \
        "model" in done.stdout
    failed = next(line for line in done.stdout.splitlines() if line.startswith("launch: FAILED: trainer on host b"))
    # the cause, not the last line the trainer printed on its way down; then why the run is not restarted again
    assert re.search(r"exited with code 1 \(trainer\.0@b\): .*(Error|error).*; every process was stopped "
                     r"\(trainer\.0 on host b exited with code 1 at step 0; all 1 restart\(s\) used\)", failed), failed
    assert [(r["process"], r["cause"]) for r in restarts_of_run(run_dir)] == [("trainer.0 on host b",
                                                                                 "exited with code 1")]
    assert (run_dir / "logs" / "restarts.log").read_text().count("restart 1/1") == 1
    assert trained_steps(run_dir) == []
    assert_nothing_left(cluster, run_dir)


def test_the_trainer_killed_on_its_host_mid_run_the_launcher_restarts_every_host_and_the_run_finishes(cluster,
                                                                                                      tmp_path):
    """kill -9 of the trainer on host b after its first step: every process on both hosts is stopped and started
    again, the run resumes from its last checkpoint (every step), trains every step once and exits 0."""
    run_dir = tmp_path / "run"
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}
    deploy = write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles)
    command = cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE), "--deploy",
                                       str(deploy), "--rl.max_steps=3", "--rl.trainer.ckpt.interval=1",
                                       "--max-restarts=2")

    def kill_the_trainer() -> None:
        pid = target_pid(cluster, "b", "trainer.toml")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    code, out = launch_with_fault(command, run_dir, kill_the_trainer, poll_s=0.05)
    assert code == 0, out[-3000:]
    restarts = restarts_of_run(run_dir)
    assert [(r["process"], r["cause"]) for r in restarts] == [("trainer.0 on host b", "was killed by signal 9")]
    assert restarts[0]["resumed_from_step"] >= 1  # a checkpoint every step: the first one at least
    (line,) = [x for x in out.splitlines() if x.startswith("launch: restart ")]
    assert line.startswith("launch: restart 1/2: trainer.0 on host b was killed by signal 9 at step "), line
    assert "launch: done, 3 steps" in out and "1 restart(s)" in out
    assert trained_steps(run_dir) == [1, 2, 3]  # each step once: the redone step's first record was dropped
    assert snapshots_stable(run_dir, 3)
    # the recipe's manifest, written on host a, counts the restart and records the outcome
    manifest = read_manifest(run_dir)
    rl = manifest["stages"]["rl"]
    assert (rl["status"], rl["exit_code"], rl["restarts"]) == ("completed", 0, 1), rl
    assert rl["restart_entries"] == [{"restart": 1, "process": "trainer.0 on host b", "host": "b",
                                      "cause": "was killed by signal 9",
                                      "failed_at_step": restarts[0]["failed_at_step"],
                                      "resumed_from_step": restarts[0]["resumed_from_step"]}]
    assert manifest["recipe"]["name"] == "tiny" and manifest["launch"]["hosts"]["b"] == cluster.hosts["b"].address
    assert manifest["overrides"]["rl"]["max_restarts"] == 2 and rl["config"]["max_steps"] == 3
    assert_nothing_left(cluster, run_dir)


def snapshots_stable(run_dir: Path, step: int) -> bool:
    from primerl.transport import snapshots

    return snapshots.is_stable(snapshots.weights_dir(run_dir, step))


def test_ctrl_c_stops_every_process_on_every_host(cluster, tmp_path):
    run_dir = tmp_path / "run"
    roles = {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}
    deploy = write_deploy(tmp_path / "deploy.toml", cluster, run_dir, roles)
    command = cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE),
                                       "--deploy", str(deploy))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # every process is up once the trainer's host has printed something
        if line.startswith("[trainer.0@b]"):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 130
    assert "launch: interrupted; stopping every process on every host" in rest
    assert_nothing_left(cluster, run_dir)
