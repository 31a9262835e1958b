"""`kvguard demo --top` (`make demo TOP=1`), as a person runs it: in a terminal (a real
pseudo-terminal here), the dashboard opens on the alerts while the demo runs, the incident's
alerts appear on it, and once `q` leaves it the demo's narration follows and the exit status
is the demo's. Without a terminal it refuses, and says why."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

from terminal_text import plain


def test_the_demo_runs_under_the_dashboard_and_its_narration_follows_q(tmp_path: Path) -> None:
    out_dir = tmp_path / "demo"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = dict(os.environ, TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "demo", "--top", "--out", str(out_dir)],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen = bytearray()

    def read() -> None:  # what the terminal is sent, as it is sent
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    narration = out_dir / "demo.txt"
    try:
        deadline = time.monotonic() + 240
        while not (narration.exists() and "done in" in narration.read_text()):
            assert proc.poll() is None, f"the demo exited early: {plain(screen)[-2000:]}"
            assert time.monotonic() < deadline, f"the demo did not finish: {plain(screen)[-2000:]}"
            time.sleep(0.5)
        # The dashboard is still up, on the alerts, and has shown the incident's.
        while "demo done" not in plain(screen):
            assert time.monotonic() < deadline, f"no 'demo done' notice: {plain(screen)[-2000:]}"
            time.sleep(0.2)
        assert proc.poll() is None, "the dashboard left by itself"
        drawn = plain(screen)
        assert "Alerts" in drawn and "rejected_progress" in drawn, drawn[-3000:]
        before_q = len(screen)
        os.write(master, b"q")
        assert proc.wait(60) == 0, plain(screen)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
        os.close(master)
    after = plain(screen[before_q:])
    # The narration, printed on the terminal once the dashboard is gone: the leak and its stop.
    assert "kvguard demo: the 2026 prefill/decode disaggregation leak" in after
    assert re.search(r"acme secret leaked\s+YES\s+no", after), after
    # acme's receipts, checked offline: the guarded response's holds clean; the leak's victim
    # has no clean receipt standing (its clean one superseded, or findings from the first).
    assert re.search(r"guarded: kvguard-receipt cmpl-\w+ -> receipt-guarded.json", after), after
    assert re.search(r"verify-receipt --key receipt.pub --tenant acme: VALID, CLEAN\n", after), after
    assert re.search(r"unguarded: kvguard-receipt cmpl-\w+ -> receipt-unguarded.json", after), after
    assert re.search(r"VALID, FINDINGS.*\n(.*\n){2}.*stale_read as victim", after), after
    assert "done in" in after
    # The guarded cluster ran with the CUDA shim: every attention launch it saw was checked.
    assert re.search(
        r"guarded-decode-0: (\d+) attention launches in \d+ steps, all \1 after a guard check", after
    ), after


def test_without_a_terminal_the_dashboard_demo_refuses() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "demo", "--top"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # no controlling terminal
    )
    assert done.returncode == 2
    assert done.stderr == (
        "kvguard demo: --top needs a terminal: there is no terminal (no /dev/tty, and neither standard "
        "input, output nor error is one)\n"
    )
