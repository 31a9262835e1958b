"""The lines atop every screen: the status line (which screen, which daemon, its mode, the
fleet's size, the alerts and how many are not acknowledged, the daemon's clock), the banner,
shown only while the daemon cannot be reached, and the last operator action's outcome.

Invariant: each is a function of the Dashboard alone (`show(data)`); the banner is visible
exactly while `data.unreachable` is set, saying that the data below is as of the last answer,
or while the daemon refuses the fleet state (`data.refused`), saying why.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvguard.tui.format import clock
from kvguard.tui.model import Dashboard


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $primary-background; color: $text; }
    """

    def __init__(self, title: str, name_of_daemon: str) -> None:
        super().__init__(id="status-line")
        self.title = title
        self.daemon = name_of_daemon

    def show(self, data: Dashboard) -> None:
        line = Text()
        line.append(f" {self.title} ", style="bold reverse")
        line.append(f" {self.daemon}")
        fleet = data.fleet
        if fleet is not None:
            line.append(f" │ {fleet.mode or 'mode ?'}", style="bold")
            line.append(f" │ {len(fleet.nodes)} nodes │ {fleet.events} events")
        shown = data.shown_alerts()
        unacked = sum(1 for alert in shown if alert.cursor not in data.acks)
        filtered = " (filtered)" if data.filter_text.strip() else ""
        line.append(f" │ {len(shown)} alerts{filtered}")
        if unacked:
            line.append(f", {unacked} new", style="bold red")
        if fleet is not None and fleet.now_ns:
            line.append(f" │ {clock(fleet.now_ns, data.tz, ms=False)}")
        self.update(line)


class Banner(Static):
    DEFAULT_CSS = """
    Banner { height: auto; background: $error; color: $text; text-style: bold; display: none; }
    """

    def __init__(self) -> None:
        super().__init__(id="banner")

    def show(self, data: Dashboard) -> None:
        error = data.unreachable
        self.display = error is not None or data.refused is not None
        if error is None:
            if data.refused is not None:
                self.update(f" the daemon refused: {data.refused}")
            return
        since = ""
        if data.fleet is not None and data.fleet.now_ns:
            since = f"; data as of {clock(data.fleet.now_ns, data.tz, ms=False)}"
        self.update(
            f" daemon unreachable, retrying: {data.address}: {error.code} {error.details[:80]}"
            f" (next try in {data.retry_in_s:.0f}s{since})"
        )


class ActionLine(Static):
    """The last operator action's outcome (the daemon's ActionResult message, or the error),
    shown from the first action on."""

    DEFAULT_CSS = """
    ActionLine { height: auto; max-height: 2; display: none; }
    ActionLine.failed { color: $error; text-style: bold; }
    """

    def __init__(self) -> None:
        super().__init__(id="action-line")

    def show(self, data: Dashboard) -> None:
        self.display = bool(data.last_result)
        self.set_class(not data.last_result_ok, "failed")
        self.update(Text(" " + data.last_result))
