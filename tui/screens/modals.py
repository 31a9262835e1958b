"""The dashboard's two modal screens: the help (every key, by screen, in the manner of htop's
and k9s's) and the confirmation an operator action goes through.

Invariants: an action reaches the daemon only from ConfirmScreen's confirm (enter in its
reason line, or its Confirm button) with a reason typed: without one it is refused on the
spot (the audit log records why every action was taken); escape or Cancel returns None and
nothing is sent. The help lists exactly the keys the screens bind
(HELP is checked against the bindings by the tests).
"""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

HELP: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "everywhere",
        (
            ("1 2 3 4 5", "fleet, pool map, alerts, timeline, rules"),
            ("?", "this help (esc closes it)"),
            ("esc", "back to the screen before"),
            ("enter", "open what is selected"),
            ("/", "filter the alerts"),
            ("q", "quit"),
            ("up down pgup pgdn", "move in a list"),
        ),
    ),
    ("1 fleet", (("enter", "the selected node's pool map"),)),
    ("2 pool map", (("[ ]", "previous, next pool of the fleet"),)),
    (
        "3 alerts",
        (
            ("enter", "the alert's request timeline"),
            ("/ then enter", "filter: critical sev:high finding:stale_read rule:ID tenant:T node:N req:R"),
            ("esc", "leave the filter line (else: back)"),
            ("a", "acknowledge the alert"),
            ("k", "kill the alert's request (every node where it is live)"),
            ("x", "quarantine the alert's pages"),
            ("m", "switch the alert's rule: monitor <-> enforce"),
        ),
    ),
    (
        "4 timeline",
        (
            ("v", "the victim's timeline, and back"),
            ("k", "kill the request shown"),
        ),
    ),
    ("5 rules", (("m enter", "switch the rule: monitor <-> enforce"), ("d", "back to the daemon's mode"))),
    (
        "confirmation",
        (("enter", "do it (the reason typed is recorded)"), ("esc", "cancel: nothing is sent")),
    ),
)


def help_table() -> Table:
    table = Table(box=None, show_header=False, expand=True, padding=(0, 1))
    table.add_column("key", style="bold", no_wrap=True)
    table.add_column("does", ratio=1)
    for section, keys in HELP:
        table.add_row(Text(section, style="reverse bold"), "")
        for key, does in keys:
            table.add_row(key, does)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close", show=False),
        Binding("q", "dismiss", "Close", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen #help-box {
        width: 90%; max-width: 100; height: auto; max-height: 90%;
        border: round $primary; background: $surface; padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "kvguard top: keys"
            box.border_subtitle = "esc closes"
            yield Static(help_table(), id="help")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[str | None]):
    """Asks before an action: `prompt` says what will be done; returns the reason or None."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen #confirm-box {
        width: 76; max-width: 95%; height: auto;
        border: thick $warning; background: $surface; padding: 0 1;
    }
    ConfirmScreen #confirm-reason { margin: 1 0 0 0; }
    ConfirmScreen #confirm-buttons { height: auto; align: right middle; }
    ConfirmScreen Button { margin: 0 1; }
    """

    def __init__(self, title: str, prompt: str) -> None:
        super().__init__()
        self.title_text = title
        self.prompt = prompt

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box") as box:
            box.border_title = self.title_text
            yield Static(Text(self.prompt), id="confirm-prompt")
            yield Input(
                placeholder="reason (required: recorded in the audit log); enter confirms",
                id="confirm-reason",
            )
            yield Static("", id="confirm-said")
            with Horizontal(id="confirm-buttons"):
                yield Button("Confirm", variant="error", id="confirm")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#confirm-reason", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._confirm(event.value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "confirm":
            self._confirm(self.query_one("#confirm-reason", Input).value)
        else:
            self.dismiss(None)

    def _confirm(self, typed: str) -> None:
        reason = typed.strip()
        if not reason:  # refused here: nothing is sent
            self.query_one("#confirm-said", Static).update("a reason is required: type why, then enter")
            self.query_one("#confirm-reason", Input).focus()
            return
        self.dismiss(reason)

    def action_cancel(self) -> None:
        self.dismiss(None)
