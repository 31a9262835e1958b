"""The dashboard application: five screens (1 fleet, 2 pool map, 3 alerts, 4 timeline, 5
rules) over one Dashboard of what the daemon last said, kept current by a poller thread (the
fleet every `refresh_s`, and what the screen in view needs) and the alert feed's thread;
operator actions go through a confirmation, then ControlService.Act, and their outcome is
shown as the daemon words it.

Invariants: the daemon is called only from the two threads and the action threads, never on
the UI's loop, and their answers reach the UI only as messages (`Fetched`, `Acted`), which
apply them to the Dashboard on the loop; while the daemon is unreachable the banner says so
and the poller retries after a Backoff wait, and the first answer after it takes the banner
away and resumes everything (the alert feed from its last cursor).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.message import Message

from kvguard.proto import pb
from kvguard.proto.client import Backoff, DaemonClient, DaemonError, Unreachable, Unsupported
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.feed import AlertFeed
from kvguard.tui.filter_text import FilterError, parse
from kvguard.tui.format import ranges
from kvguard.tui.model import Dashboard, Timeline
from kvguard.tui.screens.alerts import AlertsScreen
from kvguard.tui.screens.base import DashboardScreen
from kvguard.tui.screens.fleet import FleetScreen
from kvguard.tui.screens.modals import ConfirmScreen, HelpScreen
from kvguard.tui.screens.pool import PoolScreen
from kvguard.tui.screens.rules import RulesScreen
from kvguard.tui.screens.timeline import TimelineScreen
from kvguard.tui.terminal import TerminalDriver

SCREENS = ("fleet", "pool", "alerts", "timeline", "rules")
HISTORY = 20  # screens esc can go back through
ALERT_DRAIN_S = 0.2


@dataclass
class Update:
    """One poll's answers (each with its error, when it failed)."""

    state: svc.FleetState
    actions: list[svc.AuditRecord] = field(default_factory=list)
    actions_error: DaemonError | None = None
    rules: svc.RulesState | None = None
    rules_error: DaemonError | None = None
    pool_target: tuple[str, int] | None = None
    pool_map: svc.PoolMap | None = None
    pool_error: DaemonError | None = None
    timeline: Timeline | None = None  # the one asked about, and after which record
    timeline_after: int = 0
    timeline_records: list[svc.AuditRecord] = field(default_factory=list)
    timeline_error: DaemonError | None = None


class Fetched(Message):
    def __init__(self, update: Update | None, error: DaemonError | None = None, retry_s: float = 0) -> None:
        super().__init__()
        self.update = update
        self.error = error
        self.retry_s = retry_s


class Acted(Message):
    def __init__(self, title: str, result: svc.ActionResult | None, error: DaemonError | None) -> None:
        super().__init__()
        self.title = title
        self.result = result
        self.error = error


class TopApp(App[None]):
    TITLE = "kvguard top"
    ENABLE_COMMAND_PALETTE = False
    MODES: ClassVar[dict[str, Any]] = {
        "fleet": FleetScreen,
        "pool": PoolScreen,
        "alerts": AlertsScreen,
        "timeline": TimelineScreen,
        "rules": RulesScreen,
    }
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "show('fleet')", "Fleet"),
        Binding("2", "show('pool')", "Pool"),
        Binding("3", "show('alerts')", "Alerts"),
        Binding("4", "show('timeline')", "Timeline"),
        Binding("5", "show('rules')", "Rules"),
        Binding("question_mark", "help", "Help"),
        Binding("slash", "filter", "Filter", show=False),
        Binding("escape", "back", "Back", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        client: DaemonClient,
        *,
        refresh_s: float = 1.0,
        screen: str = "fleet",
        node: str = "",
        pool: int = 0,
        filter_text: str = "",
        tz: tzinfo | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(driver_class=TerminalDriver)  # drawn on the terminal, not on stderr
        if screen not in SCREENS:
            raise ValueError(f"screen {screen!r}: not one of {', '.join(SCREENS)}")
        self.client = client
        self.client_label = label or client.address
        self.refresh_s = refresh_s
        self.initial_screen = screen
        self.data = Dashboard(address=client.address, tz=tz)
        if node:
            self.data.pool_target = (node, pool)
        self.feed = AlertFeed(client.sibling())
        self.actor = client.sibling()  # the operator's actions
        if filter_text:
            self._read_filter(filter_text)
            self.feed.filter = self.data.query.feed_filter()
        self.backoff = Backoff()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="kvguard-top-poll", daemon=True)
        self._history: list[str] = []  # the screens shown before, for esc

    # ------------------------------------------------------------------ life

    def on_mount(self) -> None:
        self.feed.start()
        self._poller.start()
        self.set_interval(ALERT_DRAIN_S, self._drain_alerts)
        self.switch_mode(self.initial_screen)

    def on_unmount(self) -> None:
        self.stop_background()

    def stop_background(self) -> None:
        """Stop the poller and the alert feed (idempotent)."""
        self._stop.set()
        self._wake.set()
        self.feed.stop()
        self.feed.client.close()
        self.actor.close()

    def wake(self) -> None:
        """Poll now rather than at the next refresh."""
        self._wake.set()

    def refresh_screen(self) -> None:
        screen = self.screen
        if isinstance(screen, DashboardScreen):
            screen.refresh_view()

    # ------------------------------------------------------------------ polling (its own thread)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            wait = self.refresh_s
            try:
                update = self._fetch()
            except Unreachable as exc:
                wait = self.backoff.failed()
                self.post_message(Fetched(None, exc, wait))
            except DaemonError as exc:  # State refused (e.g. this certificate may not read it)
                self.post_message(Fetched(None, exc, wait))
            else:
                self.backoff.succeeded()
                self.post_message(Fetched(update))
            self._wake.wait(wait)
            self._wake.clear()

    def _fetch(self) -> Update:
        """The fleet, the acknowledgements since the last poll, and what the screen in view
        shows (rules, a pool map, a timeline). Only the fleet's failure fails the poll."""
        client, data = self.client, self.data
        update = Update(client.state())
        try:
            update.actions = client.query(Filter(kind="action", after=data.actions_after))
        except DaemonError as exc:
            update.actions_error = exc
        mode = self.current_mode
        if mode in ("rules", "alerts") or (
            data.rules is None and not isinstance(data.rules_error, Unsupported)
        ):
            try:
                update.rules = client.rules()
            except DaemonError as exc:
                update.rules_error = exc
        target = data.pool_target
        if mode == "pool" and target is not None:
            update.pool_target = target
            try:
                update.pool_map = client.pool(*target)
            except DaemonError as exc:
                update.pool_error = exc
        timeline = data.timeline
        if mode == "timeline" and timeline is not None and timeline.req:
            update.timeline, update.timeline_after = timeline, timeline.last_id
            try:
                update.timeline_records = client.query(Filter(req=timeline.req, after=update.timeline_after))
            except DaemonError as exc:
                update.timeline_error = exc
        return update

    def on_fetched(self, message: Fetched) -> None:
        data = self.data
        if message.update is None:
            assert message.error is not None
            if isinstance(message.error, Unreachable):
                data.unreachable = message.error
                data.retry_in_s = message.retry_s
            else:
                data.refused = message.error
            self.refresh_screen()
            return
        update = message.update
        if data.unreachable is not None:
            data.unreachable = None
            data.reconnects += 1
            self.feed.backoff.succeeded()
            self.feed.wake()
        data.fleet, data.refused = update.state, None
        data.polls += 1
        data.take_actions(update.actions)
        data.acks_error = update.actions_error
        if update.rules is not None or update.rules_error is not None:
            data.rules = update.rules or data.rules
            data.rules_error = update.rules_error
        if update.pool_target is not None and update.pool_target == data.pool_target:
            data.pool_map = update.pool_map or data.pool_map
            data.pool_error = update.pool_error
        if data.pool_target is None and (targets := data.pool_targets()):
            data.pool_target = targets[0]
        timeline = data.timeline
        # Answers for this timeline that cover what came after its last record (two polls may
        # have asked from the same record before either answer was applied): what is new.
        if update.timeline is timeline and timeline is not None and update.timeline_after <= timeline.last_id:
            timeline.error = update.timeline_error
            if update.timeline_error is None:
                timeline.loaded = True
                timeline.records += [r for r in update.timeline_records if r.id > timeline.last_id]
                timeline.last_id = max((r.id for r in timeline.records), default=timeline.last_id)
        self.refresh_screen()

    def _drain_alerts(self) -> None:
        generation, alerts = self.feed.drain()
        error = self.feed.error
        changed = self.data.add_alerts(generation, alerts) or error != self.data.alert_error
        self.data.alert_error = error
        if changed:
            self.refresh_screen()

    # ------------------------------------------------------------------ navigation

    def action_show(self, mode: str, *, back: bool = False) -> None:
        if mode != self.current_mode and not back:
            self._history = [*self._history[-(HISTORY - 1) :], self.current_mode]
        self.switch_mode(mode)
        if mode == "pool" and self.data.pool_target is None and (targets := self.data.pool_targets()):
            self.data.pool_target = targets[0]
        self.wake()

    def action_back(self) -> None:
        """Back to the screen before this one (esc), as a browser goes back."""
        while self._history:
            mode = self._history.pop()
            if mode != self.current_mode:
                self.action_show(mode, back=True)
                return

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        self.switch_mode("alerts")
        self.call_after_refresh(lambda: self.screen.query_one("#filter").focus())

    def open_pool(self, node: str, pool: int) -> None:
        if self.data.pool_target != (node, pool):
            self.data.pool_target = (node, pool)
            self.data.pool_map = None
            self.data.pool_error = None
        self.action_show("pool")

    def step_pool(self, by: int) -> None:
        targets = self.data.pool_targets()
        if not targets:
            return
        at = targets.index(self.data.pool_target) if self.data.pool_target in targets else -by
        node, pool = targets[(at + by) % len(targets)]
        self.open_pool(node, pool)

    def open_timeline(self, alert: svc.Alert, req: str | None = None) -> None:
        """The timeline of the alert's offender (or of `req`: its victim)."""
        self.data.timeline = Timeline(req=alert.finding.req if req is None else req, alert=alert)
        self.refresh_screen()
        self.action_show("timeline")

    def switch_timeline_party(self) -> None:
        timeline = self.data.timeline
        if timeline is None or timeline.alert is None or not timeline.victim:
            self.notify("this alert names no victim request", severity="warning")
            return
        other = timeline.victim if timeline.req == timeline.offender else timeline.offender
        self.open_timeline(timeline.alert, other)

    def _read_filter(self, text: str) -> bool:
        rules = self.data.rules.rules if self.data.rules is not None else ()
        known = {kind for r in rules for kind in r.finding.split(",") if kind}  # a rule may name several
        try:
            query = parse(text, known)
        except FilterError as exc:
            self.data.filter_error = str(exc)
            self.data.filters_refused += 1
            return False
        self.data.query, self.data.filter_text, self.data.filter_error = query, text, ""
        return True

    def set_filter_text(self, text: str) -> None:
        """The alert screen's filter line, submitted: followed from now on, or refused."""
        before = self.data.query.feed_filter()
        if self._read_filter(text) and self.data.query.feed_filter() != before:
            self.feed.set_filter(self.data.query.feed_filter())
        self.refresh_screen()

    # ------------------------------------------------------------------ actions

    def ask(self, title: str, prompt: str, action: svc.Action) -> None:
        """Confirm, then do `action` (ControlService.Act) off the UI's loop."""

        def confirmed(reason: str | None) -> None:
            if reason is None:
                self.notify(f"{title}: cancelled, nothing sent")
                return
            action.reason = reason
            threading.Thread(target=self._act, args=(title, action), daemon=True).start()

        self.push_screen(ConfirmScreen(title, prompt), confirmed)

    def _act(self, title: str, action: svc.Action) -> None:
        try:
            result = self.actor.act(action)
        except DaemonError as exc:
            self.post_message(Acted(title, None, exc))
        else:
            self.post_message(Acted(title, result, None))

    def on_acted(self, message: Acted) -> None:
        data = self.data
        if message.result is not None:
            result = message.result
            by = result.action.by or "?"
            data.last_result = f"{message.title}: {result.message} (audit record #{result.record}, by {by})"
            data.last_result_ok = True
            self.notify(result.message, title=message.title)
        else:
            data.last_result = f"{message.title} failed: {message.error}"
            data.last_result_ok = False
            self.notify(str(message.error), title=f"{message.title} failed", severity="error")
        self.refresh_screen()
        self.wake()

    def ask_kill(self, req: str, tenant: str) -> None:
        if not req:
            self.notify("this alert names no request to kill", severity="warning")
            return
        who = f" (tenant {tenant})" if tenant else ""
        prompt = (
            f"Kill request {req}{who} on every node where it is live?\n"
            "The daemon orders its engines to terminate it; its client gets an error."
        )
        self.ask("Kill request", prompt, svc.Action(kill=svc.KillRequest(req=req)))

    def ask_quarantine(self, finding: pb.Finding) -> None:
        if not finding.pages:
            self.notify("this alert names no pages to quarantine", severity="warning")
            return
        prompt = (
            f"Quarantine pool {finding.pool} pages {ranges(finding.pages)} ({len(finding.pages)} pages) "
            f"on {finding.node}?\nThe engine takes them out of circulation until it restarts."
        )
        quarantine = svc.QuarantinePages(pool=finding.pool, pages=finding.pages, finding=finding.finding)
        self.ask("Quarantine pages", prompt, svc.Action(quarantine=quarantine, node=finding.node))

    def ask_acknowledge(self, alert: svc.Alert) -> None:
        if alert.cursor in self.data.acks:
            self.notify(f"already acknowledged by {self.data.acks[alert.cursor] or '?'}")
            return
        f = alert.finding
        about = f.req or "no request"
        prompt = f"Acknowledge alert #{alert.cursor}: {f.severity} {f.finding} on {f.node} ({about})?"
        action = svc.Action(acknowledge=svc.Acknowledge(cursor=alert.cursor))
        self.ask("Acknowledge alert", prompt, action)

    def ask_rule_mode(self, rule_id: str, *, to_default: bool = False) -> None:
        rule = self.data.rule(rule_id)
        daemon_mode = self.data.rules.mode if self.data.rules is not None else ""
        current = rule.mode if rule is not None else (daemon_mode or "?")
        if to_default:
            mode, said = "", f"the daemon's mode ({daemon_mode or '?'})"
        else:
            mode = "monitor" if current == "enforce" else "enforce"
            said = mode
        what = "ordered" if mode == "enforce" else "only recorded"
        prompt = f"Switch rule {rule_id} from {current} to {said}?"
        if mode:
            prompt += f"\nIts kills and quarantines will be {what}."
        self.ask("Rule mode", prompt, svc.Action(rule_mode=svc.RuleMode(rule=rule_id, mode=mode)))
