"""kvguard's own services as child processes (tests, the demo, tools): start one, wait for the
READY line it prints when it serves, stop it politely or kill it.

Invariant: a Service exists only once its process said READY; otherwise starting it raises
with what the process wrote on its way out.
"""

from __future__ import annotations

import signal
import subprocess
import sys


class Service:
    def __init__(self, *args: str, ready: str = "READY", quiet: bool = False) -> None:
        self.args = [sys.executable, "-m", "kvguard", *args]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if quiet else subprocess.PIPE,
            text=True,
        )
        self.line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not self.line.startswith(ready):
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self._close()
            raise RuntimeError(f"kvguard {args[0]} did not start: {self.line!r} {err[-2000:]}")
        self.address = ""
        self.store = ""

    def _close(self) -> None:
        """Let go of the process's pipes (it has exited)."""
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush (what a crash looks like)."""
        self.proc.send_signal(signal.SIGKILL)
        self._close()

    def stop(self) -> str:
        """SIGTERM and wait; returns what the service wrote on stderr."""
        err = ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                _, err = self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                _, err = self.proc.communicate()  # what it said before it was killed still counts
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
