"""kvguard's own services as child processes (tests, the demo, tools): start one, wait for the
READY line it prints when it serves, stop it politely or kill it.

Invariants: a Service exists only once its process said READY; otherwise starting it raises
with what the process wrote on its way out (a quiet one's too). It is configured by its
arguments alone: the host's configuration (/etc/kvguard/kvguard.yaml, KVGUARD_CONFIG, the
KVGUARD_DAEMON_* and KVGUARD_AGENT_* variables) is not its, so a node's settings never reach
the demo's or a test's daemon.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

HOST_SETTINGS = ("KVGUARD_CONFIG", "KVGUARD_DAEMON_", "KVGUARD_AGENT_")  # what a Service leaves out


def own_environment() -> dict[str, str]:
    """This process's environment without the host's kvguard settings, and with no
    configuration file (an empty one: os.devnull)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOST_SETTINGS)}
    env["KVGUARD_CONFIG"] = os.devnull
    return env


class Service:
    def __init__(self, *args: str, ready: str = "READY", quiet: bool = False) -> None:
        self.args = [sys.executable, "-m", "kvguard", *args]
        # A quiet one's stderr goes to a file, so that why it did not start can still be said.
        self._said = tempfile.TemporaryFile("w+") if quiet else None  # noqa: SIM115 (closed in _close)
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self._said if self._said is not None else subprocess.PIPE,
            text=True,
            env=own_environment(),
        )
        self.line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not self.line.startswith(ready):
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            if self._said is not None:
                self.proc.wait()
                self._said.seek(0)
                err = self._said.read()
            self._close()
            reason = err.strip()[-2000:] or f"it exited with status {self.proc.returncode} and said nothing"
            raise RuntimeError(f"kvguard {args[0]} did not start: {reason}")
        self.address = ""
        self.store = ""

    def _close(self) -> None:
        """Let go of the process's pipes (it has exited)."""
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr, self._said):
            if pipe is not None:
                pipe.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush (what a crash looks like)."""
        self.proc.send_signal(signal.SIGKILL)
        self._close()

    def stop(self) -> str:
        """SIGTERM and wait; returns what the service wrote on stderr (a quiet one's too)."""
        err = ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                _, err = self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate()  # what it said before it was killed still counts
        else:
            self.proc.wait()
        if self._said is not None and not self._said.closed:
            self._said.seek(0)
            err = self._said.read()
        self._close()
        return err or ""


def start_daemon(store: str, port: int = 0, *args: str, quiet: bool = False) -> Service:
    """`kvguard daemon` on loopback; `.address` is host:port, `.store` the store."""
    service = Service(
        "daemon", "--listen", f"127.0.0.1:{port}", "--store", store, *args, ready="READY ", quiet=quiet
    )
    service.address = f"127.0.0.1:{service.line.split()[1]}"
    service.store = store
    return service


def start_agent(socket: str, daemon: str, spool: str, *args: str, quiet: bool = False) -> Service:
    """`kvguard agent` with its socket, daemon and spool."""
    return Service("agent", "--socket", socket, "--daemon", daemon, "--spool", spool, *args, quiet=quiet)
