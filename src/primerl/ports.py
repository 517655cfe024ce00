"""TCP ports for the servers and process groups primerl starts."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on at `host` right now (the OS picks it). Another process may take it before the
    caller binds it, so callers bind soon after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
