"""Which SSH hosts the launchers trust, and connections to them that read as one line when they fail.

Host keys are verified, by default, against the known_hosts files OpenSSH uses (`/etc/ssh/ssh_known_hosts`, then
`~/.ssh/known_hosts`) and `deploy.known_hosts` when set: a host whose key is known connects; a key that differs from
the known one is refused (a host that changed its key, or a machine in its place); an unknown key is refused in one
line naming the host, the key's fingerprint and the opt-out:

    host b (10.0.0.2:22): unknown host key ssh-ed25519 SHA256:Qk3...: not in /etc/ssh/ssh_known_hosts,
    ~/.ssh/known_hosts; check the fingerprint, then add the key (ssh-keyscan) or pass --accept-new-host-keys

The opt-out for first contact (`--accept-new-host-keys`, or `deploy.accept_new_host_keys = true`) accepts an unknown
key, records it in `deploy.known_hosts` (default `~/.ssh/known_hosts`) so the next launch verifies it, and logs each
one with its fingerprint. It never accepts a key that differs from a known one.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from primerl.config.deploy import HostSection

SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
USER_KNOWN_HOSTS = Path("~/.ssh/known_hosts")
_RECORDING = threading.Lock()  # hosts connect in parallel; their new keys go to one file
# paramiko logs a failed handshake with its traceback on stderr; the HostError line says it once, readably
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class HostError(Exception):
    """A check that failed on one host; the message says what, in one line."""


def fingerprint(key: Any) -> str:
    """`SHA256:<base64>`, as `ssh-keygen -l` and OpenSSH's prompts show a key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_hosts_entry(host: str, port: int) -> str:
    """The name a key is filed under in known_hosts: `addr`, or `[addr]:port` for a port other than 22."""
    return host if port == 22 else f"[{host}]:{port}"


class HostKeys:
    """The host-key rule of one launch: the files keys are checked against, and whether a new key is accepted (then
    recorded in `record_to` and logged through `say`)."""

    def __init__(self, known_hosts: str | None = None, accept_new: bool = False,
                 say: Callable[[str], None] | None = None):
        self.extra = Path(known_hosts).expanduser() if known_hosts else None
        self.accept_new = accept_new
        self.say = say or (lambda message: print(message, file=sys.stdout, flush=True))
        self.record_to = self.extra or USER_KNOWN_HOSTS.expanduser()

    @classmethod
    def of(cls, host: HostSection, say: Callable[[str], None] | None = None) -> HostKeys:
        """The rule `[deploy]` set for `host` (`known_hosts`, `accept_new_host_keys`; `primerl.config.deploy`)."""
        return cls(host.known_hosts_file, host.accept_new_key, say)

    def files(self) -> list[Path]:
        return [SYSTEM_KNOWN_HOSTS, USER_KNOWN_HOSTS.expanduser(), *([self.extra] if self.extra else [])]

    def describe_files(self) -> str:
        home = str(Path.home())
        return ", ".join(str(f).replace(home, "~", 1) for f in self.files())

    def apply(self, client: Any, label: str) -> None:
        """Load the known keys into a paramiko SSHClient and set what happens to an unknown one."""
        for path in self.files():
            if path.is_file():
                try:
                    client.load_system_host_keys(str(path))  # checked, never written by paramiko
                except (OSError, ValueError) as e:
                    raise HostError(f"{label}: cannot read the known_hosts file {path}: {e}") from None
        client.set_missing_host_key_policy(_Policy(self, label))

    def record(self, hostname: str, key: Any, label: str) -> None:
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _RECORDING:
            self.record_to.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.record_to, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line)
        self.say(f"launch: {label}: accepted the new host key {key.get_name()} {fingerprint(key)} and recorded it in "
                 f"{self.record_to} (--accept-new-host-keys)")


class UnknownHostKey(Exception):
    pass


def _policy_base() -> type:
    import paramiko

    return paramiko.MissingHostKeyPolicy


class _Policy(_policy_base()):  # type: ignore[misc]
    """paramiko's question "this host's key is not known: go on?": yes (and recorded) only with the opt-out."""

    def __init__(self, keys: HostKeys, label: str):
        self.keys, self.label = keys, label

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        if not self.keys.accept_new:
            raise UnknownHostKey(
                f"{self.label}: unknown host key {key.get_name()} {fingerprint(key)}: not in "
                f"{self.keys.describe_files()}; check the fingerprint, then add the key (ssh-keyscan) or pass "
                "--accept-new-host-keys")
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.keys.record(hostname, key, self.label)


def connect(host: HostSection, timeout_s: float, name: str | None = None, keys: HostKeys | None = None):
    """An open fabric Connection to `host` with its host key verified (`HostKeys`; by default the rule `[deploy]` set
    for it); HostError in one line, `host b (10.0.0.2:22): connection refused`, when it cannot be had."""
    import fabric
    import paramiko

    kwargs: dict[str, Any] = {"banner_timeout": timeout_s, "auth_timeout": timeout_s}
    if host.identity_file:
        kwargs.update(key_filename=[str(Path(host.identity_file).expanduser())], look_for_keys=False,
                      allow_agent=False)
    conn = fabric.Connection(host.address, user=host.user, port=host.port, connect_timeout=timeout_s,
                             connect_kwargs=kwargs)
    label = f"host {name} ({host.address}:{host.port})" if name else f"host {host.address}:{host.port}"
    (keys or HostKeys.of(host)).apply(conn.client, label)
    try:
        conn.open()
    except UnknownHostKey as e:
        raise HostError(str(e)) from None
    except paramiko.BadHostKeyException as e:
        raise HostError(f"{label}: host key {e.key.get_name()} {fingerprint(e.key)} differs from the known one "
                        f"{fingerprint(e.expected_key)}: refused (if the host was reinstalled, remove its old entry "
                        "with `ssh-keygen -R`)") from None
    except paramiko.AuthenticationException as e:
        raise HostError(f"{label}: refused the login of {conn.user} ({e})") from None
    except Exception as e:  # noqa: BLE001 -- socket, DNS and SSH errors, each made one readable line
        raise HostError(f"{label}: {describe_connect_error(e, timeout_s)}") from None
    return conn


def describe_connect_error(error: BaseException, timeout_s: float) -> str:
    """Why a connection failed, in words (paramiko's `[Errno None] Unable to connect to port 22 on ...` is not)."""
    import paramiko

    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {getattr(e, "errno", None) for e in error.errors.values()}
        if codes <= {errno.ECONNREFUSED}:
            return "connection refused (nothing listens on that port)"
        return "; ".join(sorted({describe_connect_error(e, timeout_s) for e in error.errors.values()}))
    if isinstance(error, socket.gaierror):
        return f"unknown host name ({error.strerror or error})"
    if isinstance(error, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout_s:g} s (host down or port filtered)"
    if isinstance(error, OSError) and error.errno is not None:
        return {errno.ECONNREFUSED: "connection refused (nothing listens on that port)",
                errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable"}.get(
            error.errno, (error.strerror or str(error)).lower())
    if isinstance(error, EOFError) or "Error reading SSH protocol banner" in str(error):
        return "the port answered, but not as an SSH server (no SSH banner)"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text.replace("[Errno None] ", "")
