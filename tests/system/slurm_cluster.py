"""A one-node Slurm cluster on this machine for the launcher tests: munged, slurmctld and slurmd with a slurm.conf
generated in a temporary directory, on ports of their own; stopped by process id.

Clients find it through SLURM_CONF (`SlurmCluster.env`). There is no accounting database; finished jobs are
recorded in the job completion log, which `sacct --completion` reads.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from primerl.ports import free_port

READY_TIMEOUT_S = 60
DAEMONS = ("munged", "slurmctld", "slurmd")


def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "slurmd and munged run as root here"
    for tool in (*DAEMONS, "sbatch", "squeue", "sacct", "scancel", "mungekey"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    return None


def _which(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


class SlurmCluster:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []
        for sub in ("state", "spool", "munge"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        (workdir / "munge").chmod(0o700)
        self.munge_socket = workdir / "munge" / "munge.socket"
        self.key = workdir / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={self.key}"], check=True, capture_output=True)
        self.key.chmod(0o400)
        self.conf = workdir / "slurm.conf"
        self.conf.write_text(self._slurm_conf())
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._start(_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                    f"--key-file={self.key}", f"--pid-file={workdir}/munge/munged.pid",
                    f"--log-file={workdir}/munge/munged.log", f"--seed-file={workdir}/munge/munged.seed")
        self._wait(lambda: self.munge_socket.exists(), "munged")
        self._start(_which("slurmctld"), "-D", "-i", "-f", str(self.conf))
        self._wait(lambda: self.query("sinfo", "-h") is not None, "slurmctld")
        self._start(_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node)
        self._wait(lambda: (self.query("sinfo", "-h", "-o", "%T") or "").strip() in ("idle", "mixed"), "slurmd")

    def _slurm_conf(self) -> str:
        w = self.workdir
        cpus = os.cpu_count() or 1
        memory_mb = 2048
        return "\n".join([
            "ClusterName=primerl-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={w}/state",
            f"SlurmdSpoolDir={w}/spool",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmdPidFile={w}/slurmd.pid",
            f"SlurmctldLogFile={w}/slurmctld.log",
            f"SlurmdLogFile={w}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={w}/jobcomp.log",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MinJobAge=600",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ])

    def _start(self, *argv: str) -> None:
        name = Path(argv[0]).name
        with open(self.workdir / f"{name}.out", "wb") as out:
            self.procs.append(subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=self.env
                                               if hasattr(self, "env") else None))

    def _wait(self, ready, name: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.2)
        logs = {p.name: p.read_text()[-2000:] for p in self.workdir.glob("*.log")} | {
            p.name: p.read_text()[-2000:] for p in self.workdir.glob("*.out")}
        raise RuntimeError(f"{name} did not become ready: {logs}")

    def query(self, *argv: str) -> str | None:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else None

    def close(self) -> None:
        for proc in reversed(self.procs):  # slurmd, slurmctld, munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
