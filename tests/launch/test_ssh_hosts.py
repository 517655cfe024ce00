"""Host-key verification and connection errors of the SSH launcher, against a real SSH server on loopback (paramiko's
server side, in a thread: it takes any public key, so what is tested is the host key and the transport)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import paramiko
import pytest

from primerl.config.deploy import HostSection
from primerl.launch.ssh_hosts import HostError, HostKeys, connect, fingerprint
from primerl.ports import free_port


class _AnyKey(paramiko.ServerInterface):
    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key) -> int:
        return paramiko.AUTH_SUCCESSFUL


class SshServer:
    """An SSH server on 127.0.0.1:<port> with host key `key`; every connection is kept until `close`."""

    def __init__(self, key: paramiko.PKey):
        self.key = key
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            transport = paramiko.Transport(client)
            transport.add_server_key(self.key)
            self.transports.append(transport)
            try:
                transport.start_server(server=_AnyKey())
            except (paramiko.SSHException, EOFError, OSError):
                pass

    def close(self) -> None:
        self.sock.close()
        for t in self.transports:
            t.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    login = paramiko.RSAKey.generate(2048)
    login.write_private_key_file(str(folder / "id_rsa"))
    return {"login": folder / "id_rsa", "host": paramiko.RSAKey.generate(2048),
            "other_host": paramiko.RSAKey.generate(2048)}


@pytest.fixture
def server(keys):
    s = SshServer(keys["host"])
    yield s
    s.close()


def host_of(server: SshServer, keys) -> HostSection:
    return HostSection(address="127.0.0.1", port=server.port, user="primerl", identity_file=str(keys["login"]))


def test_an_unknown_host_key_is_refused_in_one_line_naming_host_fingerprint_and_flag(server, keys, tmp_path):
    known = tmp_path / "known_hosts"
    with pytest.raises(HostError) as e:
        connect(host_of(server, keys), 5, name="b", keys=HostKeys(str(known)))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"host b (127.0.0.1:{server.port}): unknown host key ssh-rsa ")
    assert fingerprint(keys["host"]) in message and "--accept-new-host-keys" in message
    assert not known.exists()  # nothing recorded without the opt-out


def test_accepting_new_keys_records_and_logs_them_then_verifies_them(server, keys, tmp_path):
    known = tmp_path / "ssh" / "known_hosts"
    said: list[str] = []
    conn = connect(host_of(server, keys), 5, name="b", keys=HostKeys(str(known), accept_new=True, say=said.append))
    conn.close()
    entry = f"[127.0.0.1]:{server.port} ssh-rsa {keys['host'].get_base64()}"
    assert known.read_text() == entry + "\n" and known.stat().st_mode & 0o777 == 0o600
    assert len(said) == 1 and fingerprint(keys["host"]) in said[0] and str(known) in said[0]
    # the next launch, without the opt-out, finds the key in the file and connects; nothing more is recorded
    connect(host_of(server, keys), 5, name="b", keys=HostKeys(str(known))).close()
    assert known.read_text() == entry + "\n"


def test_a_changed_host_key_is_refused_even_with_the_opt_out(server, keys, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{server.port} ssh-rsa {keys['other_host'].get_base64()}\n")
    with pytest.raises(HostError) as e:
        connect(host_of(server, keys), 5, name="b", keys=HostKeys(str(known), accept_new=True))
    assert f"host b (127.0.0.1:{server.port}): host key ssh-rsa {fingerprint(keys['host'])} differs from the " \
           f"known one {fingerprint(keys['other_host'])}: refused" in str(e.value)
    assert known.read_text().count("\n") == 1


def test_the_deploy_tables_rule_applies_when_no_rule_is_passed(server, keys, tmp_path):
    """The Slurm target's login host connects with `connect(host, timeout)`: the [deploy] table's known_hosts and
    accept_new_host_keys reach it through the host."""
    from primerl.config.deploy import DeployConfig

    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{server.port} ssh-rsa {keys['host'].get_base64()}\n")
    deploy = DeployConfig(target="slurm", run_dir="/r", known_hosts=str(known),
                          hosts={"login": host_of(server, keys).model_dump()}, slurm={"login_host": "login"})
    connect(deploy.hosts["login"], 5).close()
    with pytest.raises(HostError, match="unknown host key"):
        connect(DeployConfig(target="slurm", run_dir="/r", known_hosts=str(tmp_path / "none"),
                             hosts={"login": host_of(server, keys).model_dump()}).hosts["login"], 5)


def test_connection_refused_reads_cleanly():
    port = free_port()
    with pytest.raises(HostError) as e:
        connect(HostSection(address="127.0.0.1", port=port), 5, name="b", keys=HostKeys(None))
    assert str(e.value) == f"host b (127.0.0.1:{port}): connection refused (nothing listens on that port)"
    assert "Errno" not in str(e.value)


def test_a_port_that_is_not_ssh_reads_cleanly(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer() -> None:
            peer, _ = listener.accept()
            peer.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            peer.close()

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(HostError) as e:
            connect(HostSection(address="127.0.0.1", port=port), 2, name="web", keys=HostKeys(None))
    assert str(e.value).startswith(f"host web (127.0.0.1:{port}): ")
    assert "Errno" not in str(e.value) and "\n" not in str(e.value)


def test_unknown_host_name_reads_cleanly():
    with pytest.raises(HostError) as e:
        connect(HostSection(address="no-such-host.invalid"), 5, name="x", keys=HostKeys(None))
    assert str(e.value).startswith("host x (no-such-host.invalid:22): unknown host name")


def test_files_checked_include_the_system_and_user_known_hosts(tmp_path):
    keys = HostKeys(str(tmp_path / "k"))
    assert keys.files() == [Path("/etc/ssh/ssh_known_hosts"), Path.home() / ".ssh" / "known_hosts", tmp_path / "k"]
    assert HostKeys().record_to == Path.home() / ".ssh" / "known_hosts"
