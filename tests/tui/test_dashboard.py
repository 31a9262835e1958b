"""`kvguard top` driven by Textual's pilot, with keys, against a real daemon fed the fixed
fleet (conftest): what each screen shows, an alert opening its request's timeline and the
victim's, the filter line, the operator's actions behind their confirmation (recorded by the
daemon with who did them), and the banner while the daemon is away, gone once it is back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from certificates import client as tls_client
from certificates import make_pki, tls_args
from daemon_helpers import stale_reads
from textual.app import App
from textual.widgets import DataTable

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import start_daemon
from kvguard.proto import pb
from kvguard.proto.channel import channel
from kvguard.proto.client import DaemonClient
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.app import TopApp
from kvguard.tui.screens.modals import ConfirmScreen, HelpScreen
from kvguard.tui.widgets.status import ActionLine, Banner, StatusLine

Until = Callable[..., Awaitable[None]]
Text = Callable[[App], str]
ALERTS = 14  # the fixed fleet's 9 findings; updates: g1 reached its client, its 3 runs' ends, an ack
WHO = "unverified:operator"  # the OS user the dashboard claims, as a plaintext daemon records it


def row(app: TopApp, table: str, key: str) -> list[str]:
    return [str(cell) for cell in app.screen.query_one(table, DataTable).get_row(key)]


def words(text: str) -> str:
    """Text with each run of blanks one space (columns' widths aside)."""
    return " ".join(text.split())


def rows(app: TopApp, table: str) -> int:
    return app.screen.query_one(table, DataTable).row_count


def loaded(app: TopApp) -> bool:
    return app.data.fleet is not None and len(app.data.alerts) == ALERTS and bool(app.data.acks)


async def type_filter(pilot: object, text: str) -> None:
    await pilot.press("slash", *text, "enter")  # type: ignore[attr-defined]


def test_the_fleet_shows_each_node_its_health_and_its_pools(
    shared_fleet, until: Until, screen_text: Text
) -> None:
    app = shared_fleet.app()

    async def drive() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(
                pilot, lambda: loaded(app) and app.screen.query_one("#nodes", DataTable).row_count == 4
            )
            assert row(app, "#nodes", "p0")[:3] == ["p0", "POOL<CTX", "96<1.0k"]  # 6 pages of 16 < 1024
            assert row(app, "#nodes", "d0")[1:3] == ["ENGINE GONE", "1.0k/1.0k"]
            assert row(app, "#nodes", "n3")[1] == "AGENT DOWN 10s" and row(app, "#nodes", "n3")[6] == "down"
            c0 = row(app, "#nodes", "c0")
            assert c0[1] == "ok" and c0[2] == "4.1k/2.0k" and c0[10:13] == ["colocated", "vllm 0.11.0", "n/a"]
            assert row(app, "#nodes", "p0")[12] == "1xH200"
            screen = screen_text(app)
            assert "1 Fleet  daemon │ enforce │ 4 nodes │ 93 events │ 14 alerts, 13 new │ 09:01:30" in screen
            assert "GPU: unavailable: NVML: libnvidia-ml.so.1 not found" in screen  # c0, selected first
            await pilot.press("down", "down", "down")  # p0
            await pilot.pause()
            screen = screen_text(app)
            assert "16 x (6 - 0 reserved) = 96 tokens < context 1024: CANNOT HOLD ITS CONTEXT" in screen
            assert "GPU: 0 NVIDIA H200 118.0GiB/141.0GiB, driver 570.86.15" in screen
            await pilot.press("enter")  # p0's pool map
            await until(pilot, lambda: app.data.pool_map is not None and app.data.pool_map.node == "p0")
            await pilot.pause()
            assert "p0 pool 0 (engine epoch 0): 6 pages" in screen_text(app)

    asyncio.run(drive())


def test_the_pool_map_tells_every_state_and_tenant_apart(
    shared_fleet, until: Until, screen_text: Text
) -> None:
    app = shared_fleet.app(screen="pool", node="c0")

    async def drive() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.data.pool_map is not None)
            await pilot.pause()
            lines = screen_text(app).splitlines()
            assert lines[1] == "c0 pool 0 (engine epoch 08:00:00): 256 pages"
            legend = "\n".join(lines[2:6])
            assert "1 cell = 1 page; 256 pages of 16 tokens" in legend
            for said in ("free 111", "owned 92", "shared 8", "offload 10", "quarantined 4", "reserved 1"):
                assert said in legend
            assert "acme 66" in legend and "globex 5" in legend
            # page 0 reserved, 1-8 acme's shared with globex, then acme's own pages
            assert lines[6].startswith("  0 #▓▓▓▓▓▓▓▓████")
            assert "oooooooooottttttttpppppppppppppp" in lines[7]  # offload, transfer, prefix cache
            assert lines[8].startswith("128 ppaaaaaa█████XXXX····")  # abort, globex's, quarantined, free
            await pilot.press("right_square_bracket")  # the next pool of the fleet: d0's
            await until(pilot, lambda: app.data.pool_map is not None and app.data.pool_map.node == "d0")

    asyncio.run(drive())


def test_an_alert_opens_its_requests_timeline_and_the_victims(
    shared_fleet, until: Until, screen_text: Text
) -> None:
    app = shared_fleet.app(screen="alerts")

    async def drive() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: loaded(app))
            await type_filter(pilot, "rule:stale_read_cross_tenant")
            await until(pilot, lambda: rows(app, "#alerts") == 2)
            assert "showing rule:stale_read_cross_tenant" in screen_text(app)
            await pilot.press("down", "enter")  # the older: globex's g1 read acme's a1
            await until(pilot, lambda: app.data.timeline is not None and app.data.timeline.loaded)
            await pilot.pause()
            screen = screen_text(app)
            assert "request g1 (offender, tenant globex): events on d0 7, p0 6" in screen
            assert "critical stale_read on d0; v: a1's timeline" in screen
            for said in (
                "d0 alloc pool 0 pages 1-8 (8)",  # decode reserved 8 pages
                "p0 xfer_send done -> d0: 1 pages 0, 1 tokens",  # prefill sent one
                "d0 read pool 0 pages 1-8 (8), 128 tokens",  # decode attended 8
                "victim a1 (acme): globex request g1 on d0 read KV written by acme request a1",
                "order kill g1 (stale_read_cross_tenant)",
            ):
                assert said in words(screen), said
            await pilot.press("v")
            await until(pilot, lambda: app.data.timeline.req == "a1" and app.data.timeline.loaded)
            await pilot.pause()
            screen = screen_text(app)
            assert "request a1 (victim, tenant acme)" in screen
            assert "p0 xfer_send done -> d0: 4 pages 0-3, 64 tokens, 64.0KiB, sums b c d e" in words(screen)
            await pilot.press("escape")
            assert app.current_mode == "alerts"
            await type_filter(pilot, "sev:urgent")  # refused: said, and nothing changes
            await pilot.pause()
            assert (
                "'sev:urgent': 'urgent' is not a severity" in screen_text(app)
                and app.data.filters_refused == 1
            )
            assert rows(app, "#alerts") == 2

    asyncio.run(drive())


def test_help_lists_the_keys_and_esc_closes_it(shared_fleet, until: Until, screen_text: Text) -> None:
    app = shared_fleet.app()

    async def drive() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            assert "1 2 3 4 5          fleet, pool map, alerts, timeline, rules" in screen_text(app)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            for key, mode in (
                ("3", "alerts"),
                ("5", "rules"),
                ("2", "pool"),
                ("4", "timeline"),
                ("1", "fleet"),
            ):
                await pilot.press(key)
                assert app.current_mode == mode
            await pilot.press("escape", "escape")  # back, as a browser goes back
            assert app.current_mode == "pool"
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(drive())


def test_a_refresh_after_a_screens_widgets_are_gone_draws_nothing_and_raises_nothing(
    shared_fleet, until: Until
) -> None:
    # As the app closes it takes each screen's widgets down while the screen is still mounted,
    # and an alert that arrives meanwhile makes the app refresh it (seen once in CI).
    app = shared_fleet.app()

    async def drive() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("3")
            await until(pilot, lambda: app.current_mode == "alerts")
            await app.screen.query_one(StatusLine).remove()
            app.refresh_screen()
            await pilot.pause()
            await pilot.press("q")
        assert app.return_code == 0

    asyncio.run(drive())


def test_operator_actions_are_confirmed_then_recorded_with_who_did_them(
    own_fleet, until: Until, screen_text: Text
) -> None:
    app = own_fleet.app(screen="alerts")
    c0 = own_fleet.streams["c0"]

    async def act(pilot: object, key: str, reason: str) -> str:
        before = app.data.last_result
        await pilot.press(key)  # type: ignore[attr-defined]
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press(*reason, "enter")  # type: ignore[attr-defined]
        await until(pilot, lambda: app.data.last_result != before)
        return app.data.last_result

    async def drive() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await until(pilot, lambda: loaded(app))
            await type_filter(pilot, "cross_tenant_share")
            await until(pilot, lambda: rows(app, "#alerts") == 1)
            share = next(a for a in app.data.alerts.values() if a.finding.finding == "cross_tenant_share")
            # esc cancels: nothing is sent
            await pilot.press("k")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            assert "Kill request g12 (tenant globex) on every node where it is live?" in screen_text(app)
            await pilot.press("escape")
            assert not isinstance(app.screen, ConfirmScreen) and app.data.last_result == ""
            # kill the live request: the daemon orders it to c0, as the operator
            said = await act(pilot, "k", "leak")
            assert said.startswith("Kill request: kill of g12 ordered to c0 (command ") and WHO in said
            await until(pilot, lambda: any(c.HasField("kill") for c in c0.commands))
            kill = next(c for c in c0.commands if c.HasField("kill"))
            assert (kill.kill.req, kill.by) == ("g12", WHO) and "leak" in kill.kill.message
            assert "Kill request: kill of g12 ordered to c0" in screen_text(app)
            # acknowledge: the mark and who
            said = await act(pilot, "a", "seen")
            assert said.startswith(f"Acknowledge alert: alert {share.cursor} acknowledged")
            await until(pilot, lambda: share.cursor in app.data.acks)
            assert row(app, "#alerts", str(share.cursor))[0] == "✓"
            assert f"acknowledged by {WHO}" in words(screen_text(app))
            # quarantine its pages (acme's pages 1-8 that globex read)
            said = await act(pilot, "x", "contain")
            assert "quarantine of 8 page(s) of pool 0 on c0 ordered" in said
            await until(pilot, lambda: any(c.HasField("quarantine") and c.by == WHO for c in c0.commands))
            # its rule to monitor, then the rules screen says so, and who
            said = await act(pilot, "m", "noisy")
            assert said.startswith("Rule mode: rule cross_tenant_share is applied in monitor mode")
            await pilot.press("5")
            await until(
                pilot, lambda: (rule := app.data.rule("cross_tenant_share")) and rule.mode == "monitor"
            )
            await pilot.pause()
            assert row(app, "#rules", "cross_tenant_share")[4:] == ["monitor*", WHO]
            # a request that has ended cannot be killed: the daemon's reason is shown
            await pilot.press("3")
            await type_filter(pilot, "stale_read")
            await until(pilot, lambda: rows(app, "#alerts") == 2)
            said = await act(pilot, "k", "late")
            assert not app.data.last_result_ok and "has already ended" in said
            assert app.screen.query_one(ActionLine).has_class("failed")

    asyncio.run(drive())
    client = DaemonClient(own_fleet.address)
    actions = [r.action for r in client.query(Filter(kind="action"))]
    client.close()
    kinds = [(a.WhichOneof("body"), a.by, a.reason) for a in actions]
    assert kinds[1:] == [  # the first: the fleet's own acknowledgement (conftest)
        ("kill", WHO, "leak"),
        ("acknowledge", WHO, "seen"),
        ("quarantine", WHO, "contain"),
        ("rule_mode", WHO, "noisy"),
    ]


def test_the_banner_says_the_daemon_is_unreachable_and_goes_once_it_is_back(
    own_fleet, until: Until, screen_text: Text
) -> None:
    app = own_fleet.app(screen="alerts")
    port = int(own_fleet.address.rsplit(":", 1)[1])

    async def drive() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: loaded(app))
            banner = app.screen.query_one(Banner)
            assert not banner.display
            own_fleet.close()
            await asyncio.to_thread(own_fleet.daemon.stop)
            await until(pilot, lambda: app.data.unreachable is not None)
            await pilot.pause()
            assert banner.display and "daemon unreachable, retrying" in screen_text(app)
            assert len(app.data.alerts) == ALERTS  # what was shown stays, said to be of before
            own_fleet.daemon = await asyncio.to_thread(start_daemon, own_fleet.store, port)
            await until(pilot, lambda: app.data.unreachable is None, timeout=20)
            await pilot.pause()
            assert not banner.display and "unreachable" not in screen_text(app) and app.data.reconnects == 1
            # data resumes: a new node's stale read is alerted once, the feed resumed after its cursor
            report = pb.PoolReport(role="colocated", page_size=16, num_pages=8, context_len=128)
            stale = pb.Event(node="r0", seq=1, ts_ns=1, pool=report)
            events = [stale]
            events.append(pb.Event(node="r0", seq=2, ts_ns=2, alloc=pb.Alloc(req="x1", pages=[3])))
            read = pb.Read(reads=[pb.ReadEntry(req="x1", pages=[3], tokens=16)])
            events.append(pb.Event(node="r0", seq=3, ts_ns=3, read=read))
            await asyncio.to_thread(own_fleet.feed, events)

            def resumed() -> bool:
                nodes = app.data.fleet.nodes if app.data.fleet is not None else ()
                return len(app.data.alerts) == ALERTS + 1 and any(n.node == "r0" for n in nodes)

            await until(pilot, resumed, timeout=20)
            newest = list(app.data.alerts.values())[-1].finding
            assert (newest.node, newest.req, newest.finding) == ("r0", "x1", "stale_read")
            # each alert was handed over once: the second stream began after the last cursor
            assert app.feed.received == ALERTS + 1 and app.feed.subscriptions >= 2

    asyncio.run(drive())


def test_against_a_daemon_without_the_newer_calls_the_dashboard_says_so_and_goes_on(
    until: Until, screen_text: Text
) -> None:
    """An older daemon: FleetService.State only (Pool, Rules, ControlService and the alert feed
    answer UNIMPLEMENTED, as a daemon from before them does: a real gRPC server that serves
    that one method, as such a daemon's did)."""
    from concurrent import futures

    import grpc

    def state(request: svc.FleetRequest, context: object) -> svc.FleetState:
        answer = svc.FleetState(events=3, requests=1)
        node = answer.nodes.add(node="old0", connected=True, last_seq=3)
        node.pools.add(node="old0", report=pb.PoolReport(page_size=16, num_pages=64, context_len=512))
        return answer

    handler = grpc.unary_unary_rpc_method_handler(
        state,
        request_deserializer=svc.FleetRequest.FromString,
        response_serializer=svc.FleetState.SerializeToString,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvguard.v1.FleetService", {"State": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = DaemonClient(f"127.0.0.1:{port}", user="operator")
    app = TopApp(client, label="old daemon")

    async def drive() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.data.fleet is not None)
            assert row(app, "#nodes", "old0")[:3] == ["old0", "ok", "1.0k/512"]
            await pilot.press("2")
            await until(pilot, lambda: app.data.pool_error is not None)
            await pilot.pause()
            assert (
                "FleetService.Pool: not served by this daemon: it is older than the dashboard"
                in screen_text(app)
            )
            await pilot.press("5")
            await until(pilot, lambda: app.data.rules_error is not None)
            await pilot.pause()
            assert "FleetService.Rules: not served by this daemon" in screen_text(app)
            await pilot.press("3")
            await until(pilot, lambda: app.data.alert_error is not None)
            await pilot.pause()
            assert "alert feed: AlertService.Subscribe: not served by this daemon" in screen_text(app)
            app.ask_kill("r1", "")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            await pilot.press("enter")  # no reason: refused on the spot, nothing sent
            await pilot.pause()
            assert isinstance(app.screen, ConfirmScreen) and not app.data.last_result
            assert "a reason is required: type why, then enter" in screen_text(app)
            await pilot.press(*"test", "enter")
            await until(pilot, lambda: bool(app.data.last_result))
            assert (
                "Kill request failed: ControlService.Act: not served by this daemon" in app.data.last_result
            )
            assert "UNIMPLEMENTED" not in screen_text(app)  # words, not gRPC's status names
            assert app.data.unreachable is None and app.data.polls >= 3  # the fleet went on

    try:
        asyncio.run(drive())
    finally:
        client.close()
        server.stop(None)


def test_under_mutual_tls_an_action_is_the_certificates_and_a_readers_is_refused(
    tmp_path: Path, until: Until, screen_text: Text
) -> None:
    """The operator's certificate names who acknowledged (the claimed OS user is not taken);
    a reader's certificate shows everything and is offered no action key (its key bar has
    none, and the keys do nothing); were it to ask, the daemon would refuse (test_roles)."""
    pki = make_pki(tmp_path)
    daemon = start_daemon(str(tmp_path / "audit.db"), 0, *tls_args(pki, "daemon"))
    node = AgentStream(channel(daemon.address, tls_client(pki, "node-p0")), "p0")
    try:
        node.send(stale_reads("p0", 1))

        async def acknowledge(app: TopApp) -> tuple[str, str]:
            async with app.run_test(size=(120, 30)) as pilot:
                await until(pilot, lambda: len(app.data.alerts) == 1 and app.data.fleet is not None)
                await pilot.pause()
                keys = screen_text(app).splitlines()[-1]  # the key bar
                await pilot.press("a")
                await pilot.pause(0.3)
                if not isinstance(app.screen, ConfirmScreen):
                    return keys, ""
                await pilot.press(*"seen", "enter")
                await until(pilot, lambda: bool(app.data.last_result))
                return keys, app.data.last_result

        for who, said in (("siem", ""), ("operator", "Acknowledge alert: alert ")):
            client = DaemonClient(daemon.address, tls_client(pki, who), user="mallory")
            try:
                keys, result = asyncio.run(acknowledge(TopApp(client, screen="alerts")))
            finally:
                client.close()
            assert result.startswith(said) and (result == "") == (who == "siem"), result
            assert ("Ack" in keys and "Kill" in keys) == (who == "operator"), keys
        assert result.endswith("by cn:alice)")
    finally:
        node.close()
        daemon.stop()
