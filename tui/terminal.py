"""Where the dashboard draws and reads its keys: the terminal itself, opened for the purpose
(the controlling terminal /dev/tty, else the terminal standard input, output or error is), as
htop and less do, never standard error as such (Textual's own driver draws on stderr): so
`kvguard top 2>top.log` draws on the terminal and logs to the file, and no redirected stream
receives a byte of the screen.

Invariant: TerminalDriver writes and reads only the descriptor `open_terminal()` gave it, and
closes it when the app ends; a process with no terminal gets NoTerminal (the command says so
and exits 2), never a screen drawn into a file or a pipe.
"""

from __future__ import annotations

import os
from typing import Any

from textual.drivers.linux_driver import LinuxDriver


class NoTerminal(RuntimeError):
    """There is no terminal to draw on."""


def open_terminal() -> int:
    """A descriptor open for reading and writing on this process's terminal."""
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        pass  # no controlling terminal (a new session): the one a standard stream is, if any
    for fd in (0, 1, 2):
        if os.isatty(fd):
            return os.open(os.ttyname(fd), os.O_RDWR | os.O_NOCTTY)
    raise NoTerminal(
        "there is no terminal (no /dev/tty, and neither standard input, output nor error is one)"
    )


class TerminalDriver(LinuxDriver):
    """Textual's Linux driver on the terminal `open_terminal()` finds, not on stderr."""

    def __init__(self, app: Any, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._terminal = open_terminal()
        self._file = open(self._terminal, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        self.fileno = self._terminal  # keys come from the same terminal
        self.input_tty = True

    def _get_terminal_size(self) -> tuple[int, int]:
        try:
            size = os.get_terminal_size(self._terminal)
        except OSError:
            return super()._get_terminal_size()
        return size.columns or 80, size.lines or 25

    def close(self) -> None:
        super().close()  # the writer thread has written its last
        if self._terminal >= 0:
            self._file.close()
            os.close(self._terminal)
            self._terminal = -1
