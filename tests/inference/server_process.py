"""Start the real `primerl inference` process on loopback and stop it by pid (shared by the server tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 300  # the embedded model may be converted on first use


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    admin_token: str
    log_path: Path

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def log(self) -> str:
        return self.log_path.read_text()


def _wait_until_serving(process: subprocess.Popen, log_path: Path) -> str:
    """The server's base URL, once /health answers 200 (the port is read from the startup log)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    base_url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()}")
        if base_url is None:
            match = re.search(r"listening on ([\d.]+):(\d+)", log_path.read_text())
            base_url = f"http://{match.group(1)}:{match.group(2)}" if match else None
        if base_url is not None:
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    return base_url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not become healthy:\n{log_path.read_text()}")


@contextmanager
def start_server(
    model: Path, workdir: Path, *args: str, admin_token: str | None = None, served_name: str = "tiny"
) -> Iterator[RunningServer]:
    """`primerl inference` on 127.0.0.1 and a free port. Without `admin_token` the server generates one and writes
    it to a token file, which is read back. Stopped with SIGTERM; the test fails if it does not shut down cleanly."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "inference.log"
    token_file = workdir / "admin_token"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_")}
    if admin_token is not None:
        env["PRIMERL_ADMIN_TOKEN"] = admin_token
    command = [
        sys.executable,
        "-m",
        "primerl.cli",
        "inference",
        "--model.name",
        str(model),
        "--served-model-name",
        served_name,
        "--port",
        "0",
        "--admin-token-file",
        str(token_file),
        *args,
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base_url = _wait_until_serving(process, log_path)
        yield RunningServer(process, base_url, token_file.read_text().strip(), log_path)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                pytest.fail(f"server ignored SIGTERM:\n{log_path.read_text()}")
