"""What runs primerl's Python on an SSH host, made ready by preflight: the project's uv environment with every package
of its uv.lock (`sync_environment`: an inexact sync, so packages installed beside the lock stay, and what it changed
said package by package), or the pinned image (`load_image`, streamed from this machine's Docker daemon).
"""

from __future__ import annotations

import re
import shlex
import subprocess

from primerl.launch.progress import root_cause
from primerl.launch.ssh_hosts import HostError


def sync_environment(conn, project_dir: str, uv: str, allowed: bool) -> str | None:
    """Make `<project_dir>/.venv` hold every package of its uv.lock: None when it already does, else what `uv sync
    --locked --inexact` changed (`describe_sync`). Inexact: packages installed beside the lock (an environment the
    user added) stay; an exact sync would uninstall them. HostError when the sync fails or is not `allowed`."""
    project, uv = shlex.quote(project_dir), shlex.quote(uv)
    if conn.run(f"cd {project} && {uv} sync --locked --inexact --check", hide=True, warn=True).exited == 0:
        return None
    if not allowed:
        raise HostError(f"{project_dir}/.venv lacks packages of uv.lock (deploy.software.sync = false)")
    result = conn.run(f"cd {project} && {uv} sync --locked --inexact", hide=True, warn=True, pty=False)
    if result.exited != 0:
        why = root_cause(result.stdout + result.stderr)
        raise HostError(f"uv sync --locked --inexact: exit {result.exited}: {why}")
    return describe_sync(result.stdout + result.stderr)


def describe_sync(output: str) -> str:
    """What `uv sync` changed, from its output's package lines (` + name==1.1`, ` - name==1.0`, ` ~ name==1.0`):
    `installed a==1, b==2; removed c==3; upgraded d 1.0 -> 1.1`, or `nothing changed`."""
    signs: dict[str, list[str]] = {"+": [], "-": [], "~": []}
    for line in output.splitlines():
        match = re.match(r"^\s*([-+~]) (\S+)", line)
        if match:
            signs[match.group(1)].append(match.group(2))
    added = {spec.split("==")[0]: spec for spec in signs["+"]}
    removed = {spec.split("==")[0]: spec for spec in signs["-"]}
    changed = [f"{name} {removed[name].partition('==')[2]} -> {added[name].partition('==')[2]}"
               for name in added if name in removed]
    parts = [(verb, specs) for verb, specs in (
        ("installed", [spec for name, spec in added.items() if name not in removed]),
        ("removed", [spec for name, spec in removed.items() if name not in added]),
        ("changed", changed), ("reinstalled", signs["~"])) if specs]
    return "; ".join(f"{verb} {', '.join(specs)}" for verb, specs in parts) or "nothing changed"


def load_image(conn, image: str) -> None:
    """Stream `docker save <image>` of this machine into `docker load` on the host."""
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    channel = conn.create_session()
    channel.set_combine_stderr(True)
    channel.exec_command("docker load")
    assert save.stdout is not None
    while chunk := save.stdout.read(1 << 20):
        channel.sendall(chunk)
    channel.shutdown_write()
    code = channel.recv_exit_status()
    if save.wait() != 0:
        raise HostError(f"image {image} is not on the host, and `docker save {image}` failed here")
    if code != 0:
        raise HostError(f"docker load of {image} failed (exit {code})")
