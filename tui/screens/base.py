"""What every screen of the dashboard has: the status line, the banner, the last action's
outcome, its own body, and the footer of key bindings; and how it is brought up to date.

Invariant: a screen draws only from the app's Dashboard (`self.data`), in `update_view`,
which the app calls after each answer from the daemon and when the screen comes back into
view; a screen never calls the daemon itself (the app's workers do, off the UI's loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from textual.app import ComposeResult
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer

from kvguard.tui.model import Dashboard
from kvguard.tui.widgets.status import ActionLine, Banner, StatusLine

if TYPE_CHECKING:
    from kvguard.tui.app import TopApp


# The bindings that act on the daemon (ControlService.Act): not offered to a reader.
ACTIONS = frozenset({"acknowledge", "kill", "quarantine", "rule_mode", "toggle", "default"})


class DashboardScreen(Screen[None]):
    TITLE = ""  # the status line's first word

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A reader's certificate may not act: its action keys are neither shown nor taken."""
        return not (action in ACTIONS and not self.top.client.may_act)

    @property
    def top(self) -> TopApp:
        return cast("TopApp", self.app)

    @property
    def data(self) -> Dashboard:
        return self.top.data

    def compose(self) -> ComposeResult:
        yield StatusLine(self.TITLE, self.top.client_label)
        yield Banner()
        yield ActionLine()
        yield from self.body()
        yield Footer()

    def body(self) -> ComposeResult:
        """The screen's own widgets, between the banner and the footer."""
        yield from ()

    def on_mount(self) -> None:
        self.refresh_view()

    def on_screen_resume(self) -> None:
        self.refresh_view()

    def refresh_view(self) -> None:
        """Bring the screen up to date with the Dashboard."""
        if not self.is_mounted:
            return
        data = self.data
        try:
            self.query_one(StatusLine).show(data)
            self.query_one(Banner).show(data)
            self.query_one(ActionLine).show(data)
            self.update_view(data)
        except NoMatches:
            # Its widgets are gone while it is still mounted: the app is closing and takes the
            # screen down, and a refresh its timers made meanwhile has nothing left to draw.
            return

    def update_view(self, data: Dashboard) -> None:
        """The screen's own part of refresh_view."""
