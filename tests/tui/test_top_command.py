"""`kvguard top` as an operator starts it: a real process in a pseudo-terminal of 80x24, on a
real daemon, quit with q; and an option it cannot use refused before the terminal is taken."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from kvguard.cli import main


def test_a_filter_it_cannot_read_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--filter", "sev:urgent node:d0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        "kvguard top: --filter: 'sev:urgent': 'urgent' is not a severity (critical, high, medium, low, info)"
    )


def read_until(fd: int, wanted: list[bytes], timeout: float = 30) -> bytes:
    """What the terminal was sent, up to when every one of `wanted` was in it."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not all(w in seen for w in wanted):
        assert time.monotonic() < deadline, f"never drew {wanted}: {seen[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the process is gone
                break
    return seen


def test_top_draws_the_daemons_alerts_in_a_terminal_and_quits_on_q(shared_fleet) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = dict(os.environ, TERM="xterm-256color")
    top = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "top", "--daemon", shared_fleet.address, "--screen", "alerts"],
        stdin=slave,
        stdout=slave,
        stderr=slave,  # where Textual draws
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    try:
        read_until(master, [b"3 Alerts", b"cross_tenant_share", b"rejected_progress", b"config_drift"])
        os.write(master, b"q")
        read_until(master, [], timeout=0)  # drain what it drew on its way out
        assert top.wait(timeout=20) == 0
    finally:
        if top.poll() is None:
            top.kill()
            top.wait()
        os.close(master)
