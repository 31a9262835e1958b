"""`kvguard top` draws on the terminal itself, not on its standard error: run as an operator
runs it with its streams redirected (`kvguard top >out 2>err`, on a real pseudo-terminal that
is its controlling terminal), the screen appears on the terminal, `q` leaves it, and neither
file holds a byte of the screen. With no terminal at all it refuses, and says why."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

from terminal_text import plain

from kvguard.cli.process import start_daemon


def test_top_draws_on_its_terminal_and_leaves_stdout_and_stderr_alone(tmp_path: Path) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    out, err = (tmp_path / "out").open("wb"), (tmp_path / "err").open("wb")

    def take_terminal() -> None:  # in the child, after setsid: the pty becomes its /dev/tty
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "top", "--daemon", daemon.address],
        stdin=slave,
        stdout=out,
        stderr=err,
        env=dict(os.environ, TERM="xterm-256color"),
        start_new_session=True,
        preexec_fn=take_terminal,
    )
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.extend(data)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while "Fleet" not in plain(screen) or daemon.address not in plain(screen):
            assert proc.poll() is None, f"top exited: {(tmp_path / 'err').read_text()}"
            assert time.monotonic() < deadline, f"no dashboard on the terminal: {plain(screen)[-2000:]}"
            time.sleep(0.2)
        os.write(master, b"q")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        out.close()
        err.close()
        daemon.stop()
    assert b"\x1b[" in screen  # drawn there, in full
    assert (tmp_path / "out").read_bytes() == b""
    assert b"\x1b" not in (tmp_path / "err").read_bytes()


def test_top_without_a_terminal_refuses_and_says_why() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "top", "--daemon", "127.0.0.1:1"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # no controlling terminal
    )
    assert done.returncode == 2
    assert done.stderr == (
        "kvguard top: there is no terminal (no /dev/tty, and neither standard input, output nor error "
        "is one); the dashboard needs one\n"
    )
    assert done.stdout == ""
