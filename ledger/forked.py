"""A ledger snapshot dumped by a forked copy of the process (`Forked`), so that its owner goes
on at once.

Invariant: the copy never outlives the thread that forked it (Linux kills it then:
PR_SET_PDEATHSIG), its owner can end it at any time (`stop`), and it is always reaped; its
failure, a signal included, is a SnapshotError that says how it ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from typing import Any

from kvguard.ledger.ledger import Ledger
from kvguard.ledger.snapshot import SnapshotError, dump


class Forked:
    """dump(ledger) by a forked copy of this process: the copy holds the ledger as it was at
    the fork (copy-on-write), dumps it on another core and writes the bytes to a pipe, while
    the caller goes on changing its own; memory grows by what either side changes meanwhile
    (at most the ledger's size). Fork from the thread that owns the ledger, between two
    events. The copy touches nothing but the ledger and the pipe (no locks, sockets or other
    threads' state) and leaves by os._exit. It never outlives the thread that forked it (Linux
    kills it then: PR_SET_PDEATHSIG); `stop()` ends it sooner."""

    def __init__(self, ledger: Ledger) -> None:
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        try:
            self.pid = os.fork()
        except OSError:
            os.close(read_fd)
            os.close(write_fd)
            raise
        if self.pid == 0:  # the copy
            code = 1
            try:
                _die_with_parent(parent)
                os.close(read_fd)
                with os.fdopen(write_fd, "wb") as out:
                    out.write(dump(ledger))
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        self._read_fd = read_fd
        self._status: int | None = None

    def result(self) -> bytes:
        """The snapshot's bytes, once the copy is done (SnapshotError if it failed, saying
        how: its exit status, or the signal that killed it). Once."""
        with os.fdopen(self._read_fd, "rb") as pipe:
            body = pipe.read()
        status = self._reap()
        if status != 0 or not body:
            how = (
                f"was killed by {signal.Signals(-status).name}"
                if status < 0
                else f"exited with status {status}"
            )
            raise SnapshotError(f"the process dumping the snapshot {how}")
        return body

    def stop(self) -> None:
        """Kill the copy if it is still at work, and reap it."""
        if self._status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._reap()

    def _reap(self) -> int:
        if self._status is None:
            try:
                self._status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:  # reaped by the other of result() and stop()
                self._status = -signal.SIGKILL
        return self._status


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Any:
    """libc's prctl, looked up before any fork (a lookup in the copy could wait forever on a
    lock another thread held at the fork); None where there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent(parent: int) -> None:
    """In a forked copy: be killed when the thread that forked it ends (the daemon's loop, or
    the daemon itself), and leave now if the parent is gone already."""
    if _PRCTL is not None:  # elsewhere the daemon still kills it when it stops
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
