"""Hosts for the launcher tests: network namespaces on this machine, each with its own address and its own sshd.

A launcher namespace holds a bridge; every host namespace is joined to it by a veth pair. Addresses (a private
/24) exist only inside these namespaces. The namespaces share this machine's filesystem, which is what a cluster's
shared filesystem gives real hosts. Everything is removed by `Cluster.close()`: sshd by process id, then the
namespaces (which takes their interfaces with them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
READY_TIMEOUT_S = 30


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def missing_tools() -> str | None:
    """Why these hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces and sshd need root"
    for tool in ("ip", "ssh-keygen", SSHD):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install openssh-server iproute2)"
    probe = f"prlprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str
    sshd: subprocess.Popen | None = None

    def pids(self) -> set[int]:
        """Every process in this host's namespace."""
        out = run("ip", "netns", "pids", self.netns, check=False).stdout
        return {int(p) for p in out.split()}


@dataclass
class Cluster:
    """Hosts `names` in namespaces on 10.<a>.<b>.0/24, plus a launcher namespace at .1 that owns the bridge."""

    workdir: Path
    names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    launcher_netns: str = ""

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 10000}"
        subnet = f"10.{100 + os.getpid() % 100}.{os.getpid() // 100 % 250}"
        self.launcher_netns = f"prl{tag}l"
        self.key, self.other_key, self.host_key, self.authorized = make_keys(self.workdir)
        ns = self.launcher_netns
        run("ip", "netns", "add", ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", ns, "addr", "add", f"{subnet}.1/24", "dev", "br0")
        run("ip", "-n", ns, "link", "set", "br0", "up")
        self.unused_address = f"{subnet}.250"  # on the network, nobody there: a host that is down
        for i, name in enumerate(self.names, start=2):
            host = Host(name, f"prl{tag}{name}", f"{subnet}.{i}")
            run("ip", "netns", "add", host.netns)
            run("ip", "-n", host.netns, "link", "set", "lo", "up")
            run("ip", "-n", host.netns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{name}", "netns", ns)
            run("ip", "-n", ns, "link", "set", f"v{name}", "master", "br0")
            run("ip", "-n", ns, "link", "set", f"v{name}", "up")
            run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            self.hosts[name] = host
            self._start_sshd(host)
        # what a user's known_hosts would hold for these hosts: the launcher verifies host keys against it
        self.known_hosts = self.workdir / "known_hosts"
        self.known_hosts.write_text("".join(known_hosts_line(h.address, 22, self.host_key)
                                            for h in self.hosts.values()))

    def _start_sshd(self, host: Host) -> None:
        host.sshd = start_sshd(self.workdir, host.name, host.address, 22, self.host_key, self.authorized, host.netns)

    def exec(self, host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("ip", "netns", "exec", self.hosts[host].netns, *args, check=check)

    def launcher_command(self, *args: str) -> list[str]:
        """`args` run in the launcher's namespace (the machine the user launches from)."""
        return ["ip", "netns", "exec", self.launcher_netns, *args]

    def stray_processes(self, host: str) -> set[int]:
        """Processes in `host`'s namespace other than its sshd listener (sessions that are closing are waited out)."""
        h = self.hosts[host]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert h.sshd is not None
            stray = h.pids() - {h.sshd.pid, *_children(h.sshd.pid)}
            if not stray or time.monotonic() > deadline:
                return stray
            time.sleep(0.2)

    def close(self) -> None:
        for host in self.hosts.values():
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.send_signal(signal.SIGTERM)
                host.sshd.wait(timeout=10)
            for pid in host.pids():  # anything a test left behind in the namespace, by id
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run("ip", "netns", "del", host.netns, check=False)
        run("ip", "netns", "del", self.launcher_netns, check=False)


def make_keys(workdir: Path) -> tuple[Path, Path, Path, Path]:
    """A login key (authorized), another key (not authorized), a host key, and the authorized_keys file."""
    key, other, host_key = workdir / "id_ed25519", workdir / "other_ed25519", workdir / "ssh_host_ed25519_key"
    for path in (key, other, host_key):
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path))
    authorized = workdir / "authorized_keys"
    authorized.write_text(key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    return key, other, host_key, authorized


def known_hosts_line(address: str, port: int, host_key: Path) -> str:
    """The known_hosts line of an sshd on address:port with `host_key`, read from the key's .pub file."""
    name = address if port == 22 else f"[{address}]:{port}"
    kind, blob = host_key.with_name(host_key.name + ".pub").read_text().split()[:2]
    return f"{name} {kind} {blob}\n"


def host_key_fingerprint(host_key: Path) -> str:
    """`SHA256:...` of `host_key`, as ssh-keygen prints it."""
    return run("ssh-keygen", "-l", "-f", str(host_key)).stdout.split()[1]


def start_sshd(workdir: Path, name: str, address: str, port: int, host_key: Path, authorized: Path,
               netns: str | None = None, extra_config: str = "") -> subprocess.Popen:
    """sshd in the foreground on address:port (inside `netns` when given), key logins only; returns once it
    accepts connections."""
    config = workdir / f"sshd_{name}.conf"
    config.write_text(
        f"ListenAddress {address}\nPort {port}\nHostKey {host_key}\nAuthorizedKeysFile {authorized}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"UsePAM no\nStrictModes no\nPidFile {workdir}/sshd_{name}.pid\nMaxSessions 50\n"
        f"MaxStartups 50\nLogLevel ERROR\nAcceptEnv none\nPrintMotd no\n{extra_config}"
    )
    in_netns = ["ip", "netns", "exec", netns] if netns else []
    with open(workdir / f"sshd_{name}.log", "wb") as log:
        sshd = subprocess.Popen([*in_netns, SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                                stderr=log)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        probe = run(*in_netns, "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}", check=False)
        if probe.returncode == 0:
            return sshd
        if sshd.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"sshd {name} did not start: {(workdir / f'sshd_{name}.log').read_text()}")


def _children(pid: int) -> set[int]:
    """`ip netns exec` execs sshd, so the listener is the Popen's own pid; kept general for wrappers."""
    out = run("pgrep", "-P", str(pid), check=False).stdout
    return {int(p) for p in out.split()}


def port_open(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((address, port)) == 0
