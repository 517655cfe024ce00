"""`primerl launch ssh`'s preflight without hosts: the environment sync (a real uv on a project made here), the
preflight table, the checklist's per-host directories, the root cause of a failing log, and `[deploy]` validation."""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import tomli_w

from primerl.launch.host_software import describe_sync, sync_environment
from primerl.launch.plan import PlanError, build_plan, load_deploy
from primerl.launch.progress import root_cause
from primerl.launch.ssh import SshTarget
from primerl.recipes.stages import load_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.toml"


def ssh_deploy(**extra) -> dict:
    return {"target": "ssh", "run_dir": "/shared/run",
            "hosts": {"a": {"address": "10.0.0.1"}, "b": {"address": "10.0.0.2"}},
            "roles": {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]}, **extra}


def load(tmp_path: Path, **deploy):
    path = tmp_path / "deploy.toml"
    path.write_text(tomli_w.dumps({"deploy": deploy}))
    recipe = load_recipe(TINY)
    return recipe, load_deploy(recipe, [path])


# ---------------------------------------------------------------------------------------------------------- [deploy]


def test_a_host_without_a_role_is_refused_in_one_line(tmp_path):
    deploy = ssh_deploy()
    deploy["hosts"]["spare"] = {"address": "10.0.0.3"}
    with pytest.raises(PlanError) as e:
        load(tmp_path, **deploy)
    assert "host(s) ['spare'] in [deploy.hosts] have no role" in str(e.value)
    assert "\n" not in str(e.value)


def test_accept_new_host_keys_comes_from_the_command_line_or_the_file(tmp_path):
    recipe, deploy = load(tmp_path, **ssh_deploy(known_hosts="/etc/cluster_known_hosts"))
    assert deploy.accept_new_host_keys is False
    assert deploy.hosts["b"].known_hosts_file == "/etc/cluster_known_hosts" and not deploy.hosts["b"].accept_new_key
    flagged = load_deploy(recipe, [tmp_path / "deploy.toml"], accept_new_host_keys=True)
    assert flagged.accept_new_host_keys and flagged.hosts["a"].accept_new_key
    _, in_file = load(tmp_path, **ssh_deploy(accept_new_host_keys=True))
    assert in_file.hosts["a"].accept_new_key


# ---------------------------------------------------------------------------------------------- the checklist's dirs


def test_every_host_gets_its_own_checklist_log_dir(tmp_path):
    recipe, deploy = load(tmp_path, **ssh_deploy())
    plan = build_plan(recipe, deploy)
    dirs = {}
    for host in ("a", "b"):
        args = plan.checklist_args(host)
        dirs[host] = args[args.index("--log-dir") + 1]
        assert args[args.index("--report") + 1] == f"/shared/run/checklist/{host}.json"
    assert dirs == {"a": "/shared/run/logs/checklist/a", "b": "/shared/run/logs/checklist/b"}


def test_primerl_check_puts_the_heavy_steps_files_in_its_log_dir(tmp_path):
    """A real heavy step (one micro-step of the fake RL trainer config): its config and log land in --log-dir, and
    nothing in the run directory's shared `logs/checklist/`."""
    from primerl.commands.check import main

    run_dir, log_dir = tmp_path / "run", tmp_path / "run" / "logs" / "checklist" / "b"
    code = main(["--only", "rl_trainer", "--run-dir", str(run_dir), "--log-dir", str(log_dir)])
    assert code == 0
    assert sorted(p.name for p in log_dir.iterdir()) == ["rl_trainer.log", "rl_trainer.micro.toml"]
    assert [p.name for p in (run_dir / "logs" / "checklist").iterdir()] == ["b"]


# -------------------------------------------------------------------------------------------------------- root cause


def test_root_cause_is_the_exception_of_the_last_traceback_not_the_last_line():
    lines = [
        "[orchestrator] step 0: waiting for rollouts",
        "[orchestrator] Traceback (most recent call last):",
        '[orchestrator]   File "buffer.py", line 88, in write',
        "[orchestrator]     path.mkdir()",
        "[inference] POST /v1/chat/completions 200",
        "[orchestrator] FileExistsError: [Errno 17] File exists: '/r/rl_smoke/rollouts/step_0'",
        "[trainer] stopping",
        "[inference] interception down",
    ]
    log = "\n".join(lines)
    assert root_cause(log) == "[orchestrator] FileExistsError: [Errno 17] File exists: '/r/rl_smoke/rollouts/step_0'"


def test_root_cause_of_chained_tracebacks_is_the_last_one():
    log = ("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\nDuring handling of the above "
           "exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"b.py\", line 2\n"
           "primerl.config.loader.ConfigError: bad key 'y'\nshutting down\n")
    assert root_cause(log) == "primerl.config.loader.ConfigError: bad key 'y'"


def test_root_cause_without_a_traceback_is_the_last_error_line_else_the_last_line():
    assert root_cause("starting\nrl: error: port 8000 is taken\nstopping the processes\n") == \
        "rl: error: port 8000 is taken"
    assert root_cause("one\ntwo\n\n") == "two"
    assert root_cause("  \n") == "(no output)"


# ------------------------------------------------------------------------------------------------- preflight table


def test_preflight_table_columns_are_aligned_and_changes_are_shown(tmp_path):
    recipe, deploy = load(tmp_path, **ssh_deploy())
    target = SshTarget(build_plan(recipe, deploy))
    target.reports["a"].steps = {"connect": ("passed", ""), "software": ("passed", ""), "rl_smoke": ("skipped", "")}
    target.reports["b"].steps = {"connect": ("failed", "host b (10.0.0.2:22): connection refused")}
    target.reports["a"].notes["software"] = "uv sync --locked --inexact in /p: installed x==1"
    lines = target.table().splitlines()
    header, row_a, row_b = lines[:3]
    for column in ("connect", "software", "rl_smoke"):
        start = header.index(column)
        for row in (row_a, row_b):
            assert row[start - 2:start] == "  " and row[start] != " ", (column, lines)
    assert row_b.split() == ["b", "failed", "-", "-"]
    assert "a: software: uv sync --locked --inexact in /p: installed x==1" in lines
    assert "b: connect failed: host b (10.0.0.2:22): connection refused" in lines


# ------------------------------------------------------------------------------------------------- environment sync


def make_wheel(folder: Path, name: str, version: str) -> Path:
    """A pure-Python wheel of one module, made by hand (nothing to download, no build backend)."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{name.replace('-', '_')}.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{dist}.dist-info/RECORD": record}.items():
            z.writestr(f, text)
    return path


@pytest.fixture
def uv_project(tmp_path, monkeypatch):
    """A project whose lock pins one package (`pinned`, a wheel beside it); its .venv synced, then `extra-env`
    installed beside the lock (an environment the user added) and `pinned` removed (the venv lags the lock)."""
    import invoke

    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_PYTHON_DOWNLOADS", "never")
    project = tmp_path / "project"
    project.mkdir()
    pinned = make_wheel(project, "pinned", "1.0")
    extra = make_wheel(tmp_path, "extra-env", "2.0")
    (project / "pyproject.toml").write_text(tomli_w.dumps({
        "project": {"name": "p", "version": "0.1.0", "requires-python": ">=3.10", "dependencies": ["pinned"]},
        "tool": {"uv": {"package": False, "sources": {"pinned": {"path": pinned.name}}}},
    }))
    conn = invoke.Context(invoke.Config(overrides={"run": {"in_stream": False}}))  # fabric's run(), here
    venv = "--python .venv/bin/python"  # uv pip: this project's environment, never the one running the tests
    for command in (f"uv lock --python {sys.executable}", f"uv sync --locked --python {sys.executable}",
                    f"uv pip install {venv} {extra}", f"uv pip uninstall {venv} pinned"):
        done = conn.run(f"cd {project} && {command}", hide=True, warn=True)
        assert done.exited == 0, f"{command}: {done.stderr}"
    return conn, project, uv


def installed(project: Path) -> set[str]:
    return {p.name.split("-")[0] for p in project.glob(".venv/lib/python*/site-packages/*.dist-info")}


def test_sync_keeps_packages_installed_beside_the_lock_and_says_what_it_changed(uv_project):
    conn, project, uv = uv_project
    assert installed(project) == {"extra_env"}
    changed = sync_environment(conn, str(project), uv, allowed=True)
    assert changed == "installed pinned==1.0"
    assert installed(project) == {"extra_env", "pinned"}  # the environment package is still there
    assert sync_environment(conn, str(project), uv, allowed=True) is None  # in sync now: nothing to do


def test_sync_not_allowed_names_the_project(uv_project):
    from primerl.launch.ssh_hosts import HostError

    conn, project, uv = uv_project
    with pytest.raises(HostError, match=r"\.venv lacks packages of uv\.lock \(deploy\.software\.sync = false\)"):
        sync_environment(conn, str(project), uv, allowed=False)
    assert installed(project) == {"extra_env"}


def test_describe_sync_reads_uvs_package_lines():
    output = ("Resolved 12 packages in 3ms\nUninstalled 2 packages in 1ms\nInstalled 2 packages in 4ms\n"
              " - numpy==2.1.0\n + numpy==2.2.1\n - oldenv==0.3\n + reverse-text==0.1.0\n ~ primerl==0.1.0\n")
    assert describe_sync(output) == ("installed reverse-text==0.1.0; removed oldenv==0.3; changed numpy 2.1.0 -> "
                                     "2.2.1; reinstalled primerl==0.1.0")
    assert describe_sync("Resolved 3 packages in 1ms\nChecked 3 packages in 0.1ms\n") == "nothing changed"
