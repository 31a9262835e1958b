"""The help screen lists every key the dashboard binds, under the screen that binds it (or
under "everywhere" for the app's own), and no key that nothing binds."""

from __future__ import annotations

from textual.binding import Binding

from kvguard.tui.app import TopApp
from kvguard.tui.screens.alerts import AlertsScreen
from kvguard.tui.screens.fleet import FleetScreen
from kvguard.tui.screens.modals import HELP, ConfirmScreen
from kvguard.tui.screens.pool import PoolScreen
from kvguard.tui.screens.rules import RulesScreen
from kvguard.tui.screens.timeline import TimelineScreen

SHOWN_AS = {
    "question_mark": "?",
    "slash": "/",
    "escape": "esc",
    "left_square_bracket": "[",
    "right_square_bracket": "]",
}
SECTIONS = {
    "everywhere": TopApp,
    "1 fleet": FleetScreen,
    "2 pool map": PoolScreen,
    "3 alerts": AlertsScreen,
    "4 timeline": TimelineScreen,
    "5 rules": RulesScreen,
    "confirmation": ConfirmScreen,
}
# Keys the widgets bind for themselves (a list's enter and moves, the reason line's enter).
NAVIGATION = {"up", "down", "pgup", "pgdn"}
WIDGETS = {
    "everywhere": {"enter", *NAVIGATION},
    "1 fleet": {"enter"},
    "3 alerts": {"enter"},
    "5 rules": {"enter"},
    "confirmation": {"enter"},
}


def helped(section: str) -> set[str]:
    """The keys the help lists under `section` ("/ then enter": / and enter)."""
    return {word for key, _ in dict(HELP)[section] for word in key.split() if word != "then"}


def bound(owner: type) -> set[str]:
    return {SHOWN_AS.get(b.key, b.key) for b in owner.BINDINGS if isinstance(b, Binding)}


def test_every_key_bound_is_in_the_help_and_every_key_in_the_help_is_bound() -> None:
    assert [section for section, _ in HELP] == list(SECTIONS)
    everywhere = helped("everywhere")
    assert everywhere == bound(TopApp) | WIDGETS["everywhere"]
    for section, owner in SECTIONS.items():
        if section == "everywhere":
            continue
        keys = bound(owner) | WIDGETS.get(section, set())
        # a screen may bind a key of everywhere's again (to show it in its footer)
        assert keys - everywhere <= helped(section) <= keys, section
