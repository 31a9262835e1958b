"""The dashboard on the whole path, for real: the testbed's engines, their guards, a node
agent and a daemon that only watches (monitor mode). The 2026 incident's request runs on,
leaking, until the operator opens its alert, reads its timeline and kills it from the
dashboard: its client gets the kill's error instead of strangers' text, and both the audit
log and the engine's own record name the operator."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from textual.app import App

from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import pb
from kvguard.proto.client import DaemonClient
from kvguard.proto.filter import Filter
from kvguard.testbed.cluster import Cluster
from kvguard.tui.app import TopApp
from kvguard.tui.screens.modals import ConfirmScreen
from kvguard.tui.screens.timeline import TimelineScreen

Until = Callable[..., Awaitable[None]]
Text = Callable[[App], str]
SECRET = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private."
WHO = "unverified:operator"  # the OS user the dashboard claims, as a plaintext daemon records it


def test_an_operator_kills_the_leaking_request_from_the_dashboard(
    tmp_path: Path, until: Until, screen_text: Text
) -> None:
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store, 0, "--mode", "monitor")  # alerts only: the kill is the operator's
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    replies: list[tuple[int, dict[str, Any]]] = []
    killed: list[str] = []  # the request the operator killed
    try:
        with Cluster(
            tmp_path / "captures",
            faults=("incident",),
            guard="monitor",
            agent_socket=sock,
            decode_step_ms=100,
        ) as c:
            assert c.complete("acme", SECRET, max_tokens=len(SECRET))[0] == 200
            # globex's prompt is longer than the prefill pool: rejected, it flows on to decode,
            # which attends to acme's stale pages for 250 steps (about 25 s) unless stopped.
            prompt = "Summarize: " + "calm markets, mild weather. " * 26
            leak = threading.Thread(
                target=lambda: replies.append(c.complete("globex", prompt, max_tokens=250))
            )
            leak.start()
            app = TopApp(DaemonClient(daemon.address, user="operator"), label="daemon", screen="alerts")

            def alert() -> pb.Finding | None:
                return next(
                    (
                        a.finding
                        for a in app.data.alerts.values()
                        if a.finding.tenant == "globex" and a.finding.finding == "rejected_progress"
                    ),
                    None,
                )

            async def drive() -> None:
                async with app.run_test(size=(120, 36)) as pilot:
                    await pilot.press("slash", *"rejected_progress", "enter")
                    await until(pilot, lambda: alert() is not None, timeout=30)
                    req = alert().req  # type: ignore[union-attr]
                    killed.append(req)
                    assert leak.is_alive(), "the request ended before the operator could act"
                    await pilot.pause(0.2)  # the table shows the alert the data holds
                    await pilot.press("enter")
                    await until(pilot, lambda: isinstance(app.screen, TimelineScreen))
                    await until(pilot, lambda: "rejected" in screen_text(app) and req in screen_text(app))
                    await pilot.press("k")
                    await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
                    assert f"Kill request {req} (tenant globex)" in screen_text(app)
                    await pilot.press(*"leaking acme's pages", "enter")
                    await until(pilot, lambda: app.data.last_result != "")
                    assert app.data.last_result_ok, app.data.last_result
                    assert (
                        f"kill of {req} ordered to " in app.data.last_result
                        and "decode-0" in app.data.last_result
                    )
                    await until(pilot, lambda: not leak.is_alive(), timeout=20)

            asyncio.run(drive())
            leak.join()
        status, reply = replies[0]
        # The client is told it was killed, and by whom; none of acme's memo reached it.
        assert status == 500 and "deal closes" not in str(reply), reply
        message = reply["error"]["message"]
        assert (
            "terminated by the kvguard daemon" in message
            and f"killed by {WHO}: leaking acme's pages" in message
        )
        client = DaemonClient(daemon.address)
        try:
            actions = [r.action for r in client.query(Filter(kind="action"))]
            kills = engine_kills(client)
        finally:
            client.close()
        assert [(a.WhichOneof("body"), a.kill.req, a.by, a.reason) for a in actions] == [
            ("kill", killed[0], WHO, "leaking acme's pages")
        ]
        # The engine's own record of the kill, relayed back through the agent, names the operator.
        assert [(k.node, k.kill.by) for k in kills] == [("decode-0", WHO)]
    finally:
        agent.stop()
        daemon.stop()


def engine_kills(client: DaemonClient) -> list[pb.Event]:
    """The engines' kill events in the store, once there are some (or after 20 s): the engine
    records the kill when it acts on the command, and its event travels back up."""
    deadline = time.monotonic() + 20
    while True:
        kills = [r.event for r in client.query(Filter(kind="event")) if r.event.HasField("kill")]
        if kills or time.monotonic() > deadline:
            return kills
        time.sleep(0.2)
