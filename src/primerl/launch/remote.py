"""The host side of a remote launch: run one process of the run, log it, stream it back, stop it when told.

    python -m primerl.launch.remote --log <run>/logs/trainer.0@b.log [--token-file F] [--grace S] -- -m primerl.cli ...

Runs `python <args>` (this interpreter) in its own process group; every output line goes to the log file and to
stdout (the launcher's SSH channel or Slurm's job log). A line `stop` on stdin, the end of stdin (the launcher's
connection dropped) or SIGTERM/SIGHUP stops the process group: SIGINT, `--grace` seconds, then SIGKILL. The exit status
is the process's (128 + signal when a signal ended it). With `--token-file`, the file's content becomes
PRIMERL_ADMIN_TOKEN, so the secret never appears on a command line.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from primerl.launch.processes import ManagedProcess, stop_all

STOP_LINE = "stop"


def _forward(process: ManagedProcess, stream) -> None:
    """Copy the log file to `stream` as it grows, until the process has ended and the log is read to its end."""
    offset = 0
    while True:
        ended = process.poll() is not None
        try:
            with open(process.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        offset += len(data)
        if data:
            stream.write(data)
            stream.flush()
        if ended:
            return
        threading.Event().wait(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primerl.launch.remote", description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, required=True, help="log file of the process")
    parser.add_argument("--token-file", type=Path, help="file whose content becomes PRIMERL_ADMIN_TOKEN")
    parser.add_argument("--grace", type=float, default=20.0, help="seconds between SIGINT and SIGKILL on stop")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the interpreter's arguments")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not args:
        parser.error("nothing to run: pass -- then the interpreter's arguments")
    env = dict(os.environ)
    if ns.token_file is not None:
        env["PRIMERL_ADMIN_TOKEN"] = ns.token_file.read_text().strip()

    process = ManagedProcess(ns.log.stem, [sys.executable, *args], ns.log, env)
    stopper = threading.Thread(target=stop_all, args=([process], ns.grace), daemon=True)
    first_stop = threading.Lock()  # never released: the first request starts the stop, the others find it taken

    def stop(*_: object) -> None:
        if first_stop.acquire(blocking=False):
            stopper.start()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == STOP_LINE:
                break
        stop()

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    process.start()
    threading.Thread(target=watch_stdin, daemon=True).start()
    forwarder = threading.Thread(target=_forward, args=(process, sys.stdout.buffer), daemon=True)
    forwarder.start()
    assert process.popen is not None
    code = process.popen.wait()
    if stopper.ident is not None:  # a stop ends by killing what the process left in sessions of its own: wait for it
        stopper.join(timeout=30)
    forwarder.join(timeout=5)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    raise SystemExit(main())
