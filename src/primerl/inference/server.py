"""`primerl inference`: the OpenAI-compatible HTTP server over a generation engine — the process entry point.

`main` reads the config, builds the engine (primerl.inference.engines.factory), binds the listening socket, settles
the admin token (primerl.inference.admin_token) and runs the app (primerl.inference.app) under uvicorn until SIGINT
or SIGTERM, giving requests in flight `SHUTDOWN_GRACE_S` to finish. A missing engine package, an unknown model or a
port it cannot bind is one line on stderr and exit code 2. Importing this module loads the web stack, which is what a
launcher that forks the server preloads.
"""

from __future__ import annotations

import logging
import socket
import sys

from primerl.config import config_from_argv
from primerl.config.inference import InferenceConfig
from primerl.cpu import keep_freed_memory
from primerl.inference.admin_token import resolve_admin_token
from primerl.inference.app import create_app
from primerl.inference.engines.factory import build_engine

log = logging.getLogger("primerl.inference")

SHUTDOWN_GRACE_S = 10  # on SIGTERM/SIGINT, requests in flight get this long to finish before they are aborted


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, made with an explicit IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    on connections from a socket that says it is TCP. With Nagle on, a response's body (written after its headers)
    waits for the client's delayed ACK, 40 ms on Linux, on every request over a kept-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv(InferenceConfig, argv, prog="primerl inference")
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    import uvicorn

    from primerl.inference.engines.hf import HFEngine
    from primerl.inference.engines.vllm import EngineUnavailable
    from primerl.models import ModelError

    try:
        engine = build_engine(cfg)
    except (EngineUnavailable, ModelError) as e:
        print(f"primerl inference: {e}", file=sys.stderr)
        return 2
    if isinstance(engine, HFEngine) and engine.device.type == "cpu":  # before it loads the model (at start):
        # every new policy version re-packs the weights for oneDNN into fresh blocks: reuse the freed ones instead of
        # faulting in new pages each time (benchmarks/NOTES.md, "Where the first 30 s of a CPU run go")
        keep_freed_memory()
    try:
        sock = listen(cfg.host, cfg.port)
    except OSError as e:
        print(f"primerl inference: cannot listen on {cfg.host}:{cfg.port}: {e.strerror}", file=sys.stderr)
        return 2
    resolve_admin_token(cfg)
    cfg.port = sock.getsockname()[1]  # the port actually bound (port 0 = any free one)
    log.info("loading %s with engine %s, listening on %s:%d", cfg.model.name, cfg.engine, cfg.host, cfg.port)
    app = create_app(engine, cfg)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on",
        timeout_keep_alive=int(cfg.keep_alive_s),
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after a graceful shutdown
        pass
    return 0
