"""The launchers' shared plan, the [deploy] schema, and the commands and scripts the targets render (no hosts)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from primerl.launch.plan import PlanError, build_plan, load_deploy
from primerl.launch.slurm import render
from primerl.recipes.stages import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"
IMAGE = "sha256:" + "ab" * 32


def deploy_file(tmp_path: Path, **deploy) -> Path:
    path = tmp_path / "deploy.toml"
    path.write_text(tomli_w.dumps({"deploy": deploy}))
    return path


def ssh_deploy(**extra):
    return {"target": "ssh", "run_dir": "/shared/run",
            "hosts": {"a": {"address": "10.0.0.1"}, "b": {"address": "10.0.0.2", "env": {"GLOO_SOCKET_IFNAME": "eth1"}}},
            "roles": {"inference": ["a"], "orchestrator": "a", "trainer": ["a", "b"]}, **extra}


def plan_for(tmp_path, **deploy):
    recipe = load_recipe(TINY)
    return build_plan(recipe, load_deploy(recipe, [deploy_file(tmp_path, **deploy)]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"roles": {"inference": ["a"], "orchestrator": "c", "trainer": ["b"]}},
         "roles name host(s) ['c'] that [deploy.hosts] lacks (hosts: a, b)"),
        ({"run_dir": "runs/x"}, "'deploy.run_dir': Value error, must be an absolute path every host sees"),
        ({"hosts": {"a": {"adress": "x"}, "b": {"address": "y"}}}, "unknown key 'deploy.hosts.a.adress'"),
        ({"roles": {"inference": ["a"], "orchestrator": "a", "trainer": ["b", "b"]}}, "lists host(s) ['b'] twice"),
        ({"checklist_skip": ["nope"]}, "unknown checklist step(s) ['nope']"),
        ({"software": {"kind": "image", "image": "primerl:cpu"}}, "must be an image id 'sha256:<64 hex digits>'"),
    ],
)
def test_bad_deploy_is_one_line_naming_key_or_host(tmp_path, change, message):
    deploy = {**ssh_deploy(), **change}
    with pytest.raises(PlanError) as e:
        load_deploy(load_recipe(TINY), [deploy_file(tmp_path, **deploy)])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path / "deploy.toml") in str(e.value) or "run_dir" in message


def test_cli_reports_bad_deploy_in_one_line_exit_2(tmp_path):
    path = deploy_file(tmp_path, **{**ssh_deploy(), "roles": {"inference": ["x"], "orchestrator": "a",
                                                                "trainer": ["a"]}})
    done = subprocess.run([sys.executable, "-m", "primerl.cli", "launch", "ssh", str(TINY), "--deploy", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "roles name host(s) ['x']" in done.stderr


def test_plan_places_roles_and_splits_the_trainer_over_hosts(tmp_path):
    plan = plan_for(tmp_path, **ssh_deploy())
    labels = [p.label for p in plan.processes]
    assert labels == ["inference.0@a", "orchestrator@a", "trainer.0@a", "trainer.1@b"]
    server, orchestrator, rank0, rank1 = plan.processes
    assert server.args[-4:] == ("--host", "10.0.0.1", "--port", "8000") and server.needs_token
    assert orchestrator.args[-2:] == ("--client.base_url", "http://10.0.0.1:8000") and orchestrator.needs_token
    for rank, p in enumerate((rank0, rank1)):
        assert f"--node-rank={rank}" in p.args and "--nnodes=2" in p.args and "--master-addr=10.0.0.1" in p.args
        assert not p.needs_token
    assert rank1.env["GLOO_SOCKET_IFNAME"] == "eth1" and "GLOO_SOCKET_IFNAME" not in rank0.env
    assert 'num_ranks = 2' in plan.files["config/orchestrator.toml"]
    assert "admin_token" not in plan.files["config/inference.toml"]
    assert plan.admin_token not in "".join(plan.files.values())


def test_the_plan_carries_the_restart_policy_and_the_resumed_runs_configs(tmp_path):
    """A recipe's rl stage restarts 3 times by default; `--max-restarts N` (a launch option) sets it; a restart writes
    the same configs with resume on (the orchestrator's `resume`, the trainer's `ckpt.resume = "latest"`)."""
    from primerl.launch.command import parse_request

    plan = plan_for(tmp_path, **ssh_deploy())
    assert (plan.max_restarts, plan.stall_timeout_s) == (3, 600.0)
    assert set(plan.resume_files) == {f"config/{p}.toml" for p in ("inference", "orchestrator", "trainer")}
    fresh = {name: tomllib.loads(text) for name, text in plan.files.items() if name.endswith(".toml")}
    resumed = {name: tomllib.loads(text) for name, text in plan.resume_files.items()}
    assert resumed["config/trainer.toml"]["ckpt"]["resume"] == "latest"
    assert "resume" not in fresh["config/trainer.toml"]["ckpt"]
    assert resumed["config/orchestrator.toml"]["resume"] is True and not fresh["config/orchestrator.toml"]["resume"]
    request = parse_request("ssh", [str(TINY), "--deploy", str(deploy_file(tmp_path, **ssh_deploy())),
                                    "--max-restarts", "1", "--rl.stall_timeout_s=60"], "")
    plan = build_plan(request.recipe, request.deploy, request.overrides)
    assert (plan.max_restarts, plan.stall_timeout_s) == (1, 60.0)
    bad = subprocess.run([sys.executable, "-m", "primerl.cli", "launch", "ssh", str(TINY), "--deploy",
                          str(tmp_path / "deploy.toml"), "--max-restarts", "-1", "--dry-run"], capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and "max_restarts" in bad.stderr and "Traceback" not in bad.stderr


def test_one_trainer_host_runs_without_torchrun(tmp_path):
    plan = plan_for(tmp_path, **{**ssh_deploy(), "roles": {"inference": ["a"], "orchestrator": "a",
                                                          "trainer": ["b"]}})
    assert plan.processes[-1].args[:4] == ("-m", "primerl.cli", "trainer", "@")


def test_supervised_command_runs_from_the_project_with_the_venv(tmp_path):
    plan = plan_for(tmp_path, **ssh_deploy(software={"project_dir": "/opt/p"}))
    trainer = plan.processes[-1]
    words = shlex.split(plan.software.shell(plan.supervised_args(trainer), trainer.env))
    assert words[:4] == ["cd", "/opt/p", "&&", "exec"]
    assert "/opt/p/.venv/bin/python" in words
    i = words.index("primerl.launch.remote")
    assert words[i + 1:i + 3] == ["--log", "/shared/run/logs/trainer.1@b.log"] and "--token-file" not in words


def test_image_software_runs_docker_by_image_id(tmp_path):
    plan = plan_for(tmp_path, **ssh_deploy(software={"kind": "image", "image": IMAGE}))
    server = plan.processes[0]
    command = plan.software.shell(plan.supervised_args(server), server.env)
    words = shlex.split(command.replace('"$(id -u):$(id -g)"', "UID:GID"))
    assert words[:4] == ["exec", "docker", "run", "--rm"]
    assert words[words.index("--user") + 1] == "UID:GID" and words[words.index("--network") + 1] == "host"
    assert "/shared/run:/shared/run" in words and f"PRIMERL_IMAGE_ID={IMAGE}" in words
    assert words[words.index(IMAGE) + 1:words.index(IMAGE) + 4] == ["python", "-m", "primerl.launch.remote"]
    assert "--gpus" not in words  # a CPU recipe
    assert plan.recipe_on_hosts == "/opt/primerl/recipes/tiny.toml"


def test_image_defaults_to_the_recipes_pin_and_says_when_there_is_none(tmp_path):
    with pytest.raises(PlanError, match="pins no image for"):
        plan_for(tmp_path, **ssh_deploy(software={"kind": "image"}))


def test_several_servers_each_on_its_port_and_all_known_to_the_orchestrator(tmp_path):
    roles = {"inference": ["a", "b", "a"], "orchestrator": "a", "trainer": ["b"]}
    plan = plan_for(tmp_path, **ssh_deploy(roles=roles))
    servers = [p for p in plan.processes if p.role == "inference"]
    assert [p.label for p in servers] == ["inference.0@a", "inference.1@b", "inference.2@a"]
    assert [p.args[-3:] for p in servers] == [("10.0.0.1", "--port", "8000"), ("10.0.0.2", "--port", "8000"),
                                              ("10.0.0.1", "--port", "8001")]
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.1:8001"]
    orchestrator = next(p for p in plan.processes if p.role == "orchestrator")
    assert orchestrator.args[-2:] == ("--client.base_urls", json.dumps(urls))
    assert tomllib.loads(plan.files["config/orchestrator.toml"])["client"]["base_urls"] == urls


def test_broadcast_weight_transfer_is_refused_by_name(tmp_path):
    recipe = load_recipe(TINY)
    deploy = load_deploy(recipe, [deploy_file(tmp_path, **ssh_deploy())])
    with pytest.raises(PlanError, match="rl.weight_transfer = 'broadcast'"):
        build_plan(recipe, deploy, {"rl": {"weight_transfer": "broadcast"}})


def slurm_script(tmp_path, **slurm) -> str:
    recipe = load_recipe(TINY)
    deploy = load_deploy(recipe, [deploy_file(tmp_path, target="slurm", run_dir="/shared/run", slurm=slurm)])
    return render(recipe, deploy, {"rl": {"max_steps": "2"}}).script


def test_one_node_job_runs_the_checklist_then_the_recipe(tmp_path):
    script = slurm_script(tmp_path, partition="cpu", time_limit="00:10:00", extra=["--qos=low"])
    assert "#SBATCH --partition=cpu\n" in script and "#SBATCH --qos=low\n" in script
    assert "#SBATCH --output=/shared/run/logs/slurm-%j.out" in script
    check = script.index(" check ")
    run = script.index(" run ")
    assert check < run and "--no-check --run-dir /shared/run --rl.max_steps=2" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0


def test_one_node_job_is_requeued_and_then_resumes_the_run(tmp_path):
    script = slurm_script(tmp_path)
    assert "#SBATCH --requeue\n" in script and "#SBATCH --open-mode=append\n" in script
    # the recipe's line, run by bash with `python` replaced by echo: the first start does not resume, a requeued one does
    (line,) = [line for line in script.splitlines() if " run " in line and "--run-dir" in line]
    start = script.index("RESUME=()")
    snippet = script[start:script.index("\n", script.index(line))].replace(line.split()[0], "echo")
    for count, resumes in (("0", False), ("2", True)):
        env = {"PATH": "/usr/bin:/bin", "SLURM_RESTART_COUNT": count, "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", snippet], env=env, capture_output=True, text=True,
                             check=True).stdout
        assert out.rstrip().endswith("--rl.max_steps=2 --rl.resume=true") is resumes, out
        # a requeued job first records its restart (in metrics.jsonl, restarts.log and the manifest), then resumes
        record = ("-m primerl.launch.restart requeued --run-dir /shared/run --prefix primerl --host n1 --job 7 "
                  "--count 2")
        assert (record in out) is resumes, out
    multi = slurm_script(tmp_path, nodes=3, inference_nodes=1)
    assert "--requeue" not in multi  # the roles of several nodes do not resume


def test_multi_node_job_has_one_srun_per_role_on_its_node(tmp_path):
    script = slurm_script(tmp_path, nodes=3, inference_nodes=1)
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    lines = script.splitlines()
    sruns = [line for line in lines if line.startswith("srun --overlap --nodes=1") and line.endswith("&")]
    assert len(sruns) == 4
    # the run's manifest is built on the first node before any role starts; its outcome is recorded on every end
    (start,) = [i for i, line in enumerate(lines) if "primerl.launch.manifest start" in line]
    assert start < lines.index(sruns[0]) and '--nodelist="${NODES[0]}"' in lines[start]
    assert "--recipe " in lines[start] and '--host "${NODES[0]}"' in lines[start]
    assert [line.strip() for line in lines if line.strip().startswith("manifest_end ")] == ["manifest_end 1",
                                                                                           "manifest_end 0"]
    assert "trap 'stop_all; manifest_end 130; exit 130' INT TERM" in lines
    assert '--nodelist="${NODES[0]}"' in sruns[0] and '--host "${NODES[0]}"' in sruns[0]
    assert '--client.base_url http://"${NODES[0]}":8000' in sruns[1]
    assert '--nodelist="${NODES[1]}"' in sruns[2] and '--master-addr="${NODES[1]}"' in sruns[2]
    assert '--nodelist="${NODES[2]}"' in sruns[3] and "--node-rank=1" in sruns[3]
    # the quoting survives bash: expand one line with a made-up node list
    expanded = subprocess.run(
        ["bash", "-c", 'NODES=(n0 n1 n2); printf "%s\\n" ' + sruns[3].removesuffix(" < /dev/null &")],
        capture_output=True, text=True, check=True).stdout.splitlines()
    assert "--nodelist=n2" in expanded and "--master-addr=n1" in expanded


def test_remote_wrapper_stops_its_process_group_when_told(tmp_path):
    """`primerl.launch.remote` streams the child's output; `stop` on stdin ends the child and what it started."""
    log = tmp_path / "child.log"
    child = ("import subprocess, time; p = subprocess.Popen(['sleep', '300']); print('ready', p.pid, flush=True); "
             "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-m", "primerl.launch.remote", "--log", str(log), "--grace", "2", "--",
                             "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("$ ")  # the command line, as the log's first line
    word, grandchild = proc.stdout.readline().split()
    assert word == "ready"
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) != 0
    assert "ready" in log.read_text()
    assert _gone(int(grandchild), timeout_s=30)


def test_remote_wrapper_stop_ends_a_stopped_grandchild_in_a_session_of_its_own(tmp_path):
    """What torchrun does with its ranks: a grandchild in its own session, out of reach of the group's signals; here
    SIGSTOPped too (a hung rank). `stop` must end it before the wrapper exits."""
    child = ("import subprocess, time; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
             "print('ready', p.pid, flush=True); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-m", "primerl.launch.remote", "--log", str(tmp_path / "c.log"),
                             "--grace", "1", "--", "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()
    word, grandchild = proc.stdout.readline().split()
    assert word == "ready"
    os.kill(int(grandchild), signal.SIGSTOP)
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    assert proc.wait(timeout=60) != 0
    assert _gone(int(grandchild), timeout_s=10)


def test_remote_wrapper_stops_when_the_launcher_connection_ends(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "primerl.launch.remote", "--log", str(tmp_path / "x.log"), "--",
                             "-c", "import time; print('up', flush=True); time.sleep(300)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    assert proc.stdout.readline() == "up\n"
    proc.stdin.close()  # what a dropped SSH connection looks like from the host
    assert proc.wait(timeout=60) != 0


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False
