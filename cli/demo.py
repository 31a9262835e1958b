"""`make demo` / `kvguard demo`: the 2026 prefill/decode leak, happening and stopped.

Two testbed clusters (router, prefill and decode worker each) run side by side with the
`incident` fault switch on: one unguarded (kvguard only watching, in monitor mode), one
guarded (enforce). Both serve the same ordinary traffic of two tenants; then globex sends a
prompt longer than the prefill KV pool to both. The unguarded one answers HTTP 200 with
acme's confidential text; the guarded one answers with an error and no secret. Every guard
streams its events through a node agent to a daemon (SQLite audit store) that records and
alerts (monitor mode: the local guards do the enforcing here), and the demo ends with the
daemon's exposure report for acme.
Invariant: the demo prints what the clients actually received, never a scripted result.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from kvguard.cli.options import Subcommands, add_command
from kvguard.cli.process import start_agent, start_daemon
from kvguard.cli.testbed import testbed_missing

# The testbed (torch) and the audit log's readers are imported when the demo runs, so that
# `kvguard --help` does not wait for them.

SECRET = "acme board memo: we acquire Initech at 4.2B on Dec 14, do not disclose. "
ORDINARY = [
    ("acme", "Draft a polite reminder about the invoice due Friday."),
    ("globex", "What is the boiling point of water at 2000 m?"),
    ("acme", SECRET),
]
OVERLONG = "Summarize the following report: " + "quarterly numbers look stable and growth continues. " * 13


def _short(text: str, width: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def run_demo(out_dir: Path, out: TextIO = sys.stdout, *, top: bool = False) -> int:
    """Run the demo in `out_dir` (emptied first), narrating on `out`: 0 when the unguarded
    cluster leaked acme's secret and the guarded one answered an error without it, else 1.
    `top`: with the dashboard (`kvguard top`) on the daemon meanwhile, open until it is quit;
    the narration follows once it is."""
    started = time.monotonic()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    store = out_dir / "audit.db"
    sock = out_dir / "agent.sock"
    from kvguard.proto.receipt import new_key

    new_key(out_dir / "receipt.key", out_dir / "receipt.pub")  # what `kvguard certs init` makes
    key = str(out_dir / "receipt.key")
    daemon = start_daemon(str(store), 0, "--mode", "monitor", "--receipt-key", key, quiet=True)
    address = daemon.address
    agent = start_agent(str(sock), address, str(out_dir / "spool"), quiet=True)
    try:
        if top:
            return _with_dashboard(out_dir, store, sock, address, started, out)
        return _demo(out_dir, store, sock, address, started, out)
    finally:
        agent.stop()
        daemon.stop()


def _no_terminal() -> str:
    """Why the dashboard cannot be drawn ("" when it can)."""
    from kvguard.tui.terminal import NoTerminal, open_terminal

    try:
        os.close(open_terminal())
    except NoTerminal as exc:
        return str(exc)
    return ""


def _with_dashboard(out_dir: Path, store: Path, sock: Path, address: str, started: float, out: TextIO) -> int:
    """The demo in a thread, its narration kept in out_dir/demo.txt, while the dashboard runs
    on this terminal against the demo's daemon, on its alerts; the narration is printed once
    the dashboard is quit (after the demo, if it has not ended by then)."""
    from kvguard.proto.client import DaemonClient
    from kvguard.tui.app import TopApp

    client = DaemonClient(address, None)
    app = TopApp(client, screen="alerts", label=f"kvguard demo ({address})")
    result: list[int] = []
    narration = out_dir / "demo.txt"

    def demo() -> None:
        with narration.open("w") as text:
            try:
                result.append(_demo(out_dir, store, sock, address, started, text))
            except Exception as exc:  # said on the dashboard and after it, never lost in a thread
                text.write(f"\nthe demo failed: {exc!r}\n")
                result.append(1)
        verdict = "the leak unguarded, stopped guarded" if result == [0] else "not as expected"
        with contextlib.suppress(RuntimeError):  # the dashboard was quit already
            said = f"demo done: {verdict}; q leaves, the narration follows"
            app.call_from_thread(app.notify, said, timeout=30)

    worker = threading.Thread(target=demo, name="kvguard-demo", daemon=True)
    worker.start()
    try:
        app.run()
    finally:
        app.stop_background()
        client.close()
    if worker.is_alive():
        out.write("kvguard demo: the dashboard was quit; the demo is finishing...\n")
        out.flush()
        worker.join()
    out.write(narration.read_text())
    return result[0] if result else 1


def _settled(spool: Path) -> None:
    """Wait until the agent has nothing left to deliver (its spool files are empty)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(f.stat().st_size == 0 for f in spool.glob("*.spool")):
            return
        time.sleep(0.1)


def _demo(out_dir: Path, store: Path, sock: Path, address: str, started: float, out: TextIO) -> int:
    from kvguard.agents.guard import SHIM_LIBRARY
    from kvguard.daemon.audit.exposure import exposure_of, format_exposure
    from kvguard.daemon.audit.source import open_source
    from kvguard.testbed.cluster import Cluster

    runs = {"unguarded": "monitor", "guarded": "enforce"}
    witness = SHIM_LIBRARY.exists()  # the guarded cluster's workers run with the CUDA shim preloaded
    clusters = {
        name: Cluster(
            out_dir / name,
            faults=("incident",),
            guard=mode,
            agent_socket=str(sock),
            node_prefix=f"{name}-",
            cuda_witness=witness and name == "guarded",
        )
        for name, mode in runs.items()
    }
    p = out.write
    p("kvguard demo: the 2026 prefill/decode disaggregation leak, unguarded and guarded\n\n")
    p("Two testbed clusters (router + prefill worker + decode worker, real paged attention, KV sent\n")
    p("over TCP) run with the `incident` fault switch: the prefill KV pool is smaller than the\n")
    p("context, admission asks finished() instead of rejected, a one-page hand-off is reported done.\n")
    p("unguarded = kvguard in monitor mode (it reports, never acts); guarded = enforce.\n")
    p(f"Both clusters' guards stream to one node agent and the kvguard daemon at {address}.\n\n")
    try:  # a cluster that started is stopped even when the other did not start
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda c: c.__enter__(), clusters.values()))
        _, models = clusters["guarded"].get("/v1/models")
        context = models["data"][0]["max_model_len"]
        up = time.monotonic() - started
        p(f"clusters up in {up:.1f}s; model kvguard-echo, max_model_len {context}\n\n")
        p("1. ordinary traffic (the echo model answers with its prompt, so a leak shows verbatim)\n")
        secret: dict[str, str] = {}  # cluster -> the kvguard-receipt id of acme's secret request
        for tenant, prompt in ORDINARY:
            cells = []
            for name, cluster in clusters.items():
                status, reply = cluster.complete(tenant, prompt, max_tokens=len(prompt.encode()))
                ok = status == 200 and Cluster.text(reply) == prompt
                cells.append(f"{name} {status} {'exact' if ok else 'WRONG'}")
                if prompt == SECRET:
                    secret[name] = cluster.last_receipt
            p(f"   {tenant:7} {_short(prompt, 46):46}  {'   '.join(cells)}\n")
        prompt_tokens = len(OVERLONG.encode())
        p(f"\n2. globex sends a {prompt_tokens}-token prompt (longer than the prefill pool), ")
        p("max_tokens 96\n\n")
        results: dict[str, tuple[int, dict[str, Any]]] = {}
        overlong: dict[str, str] = {}  # cluster -> the kvguard-receipt id of globex's request
        for name, cluster in clusters.items():
            results[name] = cluster.complete("globex", OVERLONG, max_tokens=96)
            overlong[name] = cluster.last_receipt
        width = 44
        p(f"   {'':22}{'unguarded':{width}}  guarded\n")
        status = {n: str(r[0]) for n, r in results.items()}
        p(f"   {'HTTP status':22}{status['unguarded']:{width}}  {status['guarded']}\n")
        bodies = {
            n: Cluster.text(r) if s == 200 else r.get("error", {}).get("message", "")
            for n, (s, r) in results.items()
        }
        left = textwrap.wrap(repr(bodies["unguarded"]), width) or [""]
        right = textwrap.wrap(bodies["guarded"], width) or [""]
        for i in range(max(len(left), len(right))):
            label = "what the client got" if i == 0 else ""
            cell_l, cell_r = (left[i] if i < len(left) else ""), (right[i] if i < len(right) else "")
            p(f"   {label:22}{cell_l:{width}}  {cell_r}\n")
        leaked = {n: "Initech" in bodies[n] for n in bodies}
        p(
            f"   {'acme secret leaked':22}{'YES' if leaked['unguarded'] else 'no':{width}}  "
            f"{'YES' if leaked['guarded'] else 'no'}\n"
        )
        p("\n3. what each cluster's guards found (one line a finding; in monitor mode an action is\n")
        p("   only what enforce would have done: `would kill`)\n")
        for name, cluster in clusters.items():
            findings = cluster.findings()
            p(f"\n   {name} ({len(findings)}):\n")
            for f in findings:
                acts = f["action"] not in ("alert", "log")  # alerts are made in either mode
                action = f"would {f['action']}" if runs[name] == "monitor" and acts else f["action"]
                victim = f" victim {f['victim_tenant']}" if f.get("victim_tenant") else ""
                p(f"   {f['severity'].upper():8} {action:18} {f['rule']:26} {f['node']:10}{victim}\n")
    finally:
        for cluster in clusters.values():
            cluster.__exit__(None, None, None)
    _settled(out_dir / "spool")
    p("\n4. the CUDA launch witness on the guarded cluster (the kvguard shim preloaded into its\n")
    p("   workers; on this CPU their decode kernels launch on a stand-in CUDA driver)\n\n")
    line = _witness_line(store, "guarded-decode-0") if witness else "not run: the shim is not built"
    p(f"   {line}\n")
    p("\n5. the daemon's exposure report for acme (kvguard audit exposure --tenant acme):\n\n")
    format_exposure(exposure_of(open_source(str(store), None), "acme"), _Indented(out))
    p("\n6. acme's receipts for its confidential request (the response's kvguard-receipt header names\n")
    p("   it; `kvguard audit receipt ID -o json`, checked offline with `kvguard audit verify-receipt`)\n")
    receipts = _receipts(out_dir, store, secret, overlong.get("unguarded", ""), p)
    p(f"\naudit log: {store} (kvguard audit query --store {store}; kvguard audit verify --store {store})\n")
    p(f"\ndone in {time.monotonic() - started:.1f}s\n")
    good = leaked["unguarded"] and not leaked["guarded"] and results["guarded"][0] >= 500 and receipts
    return 0 if good else 1


def _receipts(out_dir: Path, store: Path, secret: dict[str, str], offender: str, p: Any) -> bool:
    """Print the guarded cluster's receipt of acme's secret request, verified offline with the
    public key alone, and the unguarded one's (the leak's victim), then the offending request's:
    whether they came out as they must (the guarded one valid; the victim's current one not
    clean)."""
    from kvguard.daemon.audit.source import open_source
    from kvguard.proto import receipt
    from kvguard.proto.filter import Filter
    from kvguard.proto.kvguard.v1 import services_pb2 as svc

    def current(req: str) -> tuple[int, svc.SignedReceipt] | None:
        source = open_source(str(store), None)
        try:
            found = [(i.id, i.body) for i in source.records(Filter(kind="receipt", req=req))]
        finally:
            source.close()
        kept = [(rid, body) for rid, body in found if isinstance(body, svc.SignedReceipt)]
        return kept[-1] if kept else None

    deadline = time.monotonic() + 20  # a receipt follows its request's end within a second
    while time.monotonic() < deadline and not all(current(req) for req in secret.values() if req):
        time.sleep(0.1)
    public = receipt.load_public(out_dir / "receipt.pub")
    ok = True
    for name in ("guarded", "unguarded"):
        req = secret.get(name, "")
        found = current(req) if req else None
        if found is None:
            p(f"\n   {name}: no receipt of {req or 'its request (no kvguard-receipt header)'}\n")
            ok = False
            continue
        record_id, signed = found
        path = out_dir / f"receipt-{name}.json"
        path.write_bytes(receipt.to_file(signed))
        verdict = receipt.verify(receipt.from_file(path), public, tenant="acme", req=req)
        r = verdict.receipt
        assert r is not None
        p(f"\n   {name}: kvguard-receipt {req} -> {path.name} (record {record_id})\n")
        p(f"   verify-receipt --key receipt.pub --tenant acme: {'VALID' if verdict.ok else 'REFUSED'}, ")
        p(f"{r.verdict.upper()}" + (f" (supersedes record {r.supersedes})" if r.supersedes else "") + "\n")
        for line in verdict.proves:
            p(f"     proves: {line}\n")
        # The guarded response's receipt holds; the leak's victim has no clean one standing.
        ok = ok and verdict.ok and (name == "guarded" or r.verdict != "clean")
    found = current(offender) if offender else None
    if found is not None:
        r = svc.Receipt.FromString(found[1].receipt)
        sources = ", ".join(f"{s.pages} {s.kind}" for s in r.sources)
        p(f"\n   and globex's request on the unguarded cluster ({offender}): {r.verdict.upper()}; ")
        p(f"its pages' KV: {sources}\n")
    p(f"\n   receipt key: {out_dir / 'receipt.pub'} (`kvguard audit receipt-key` prints it)\n")
    return ok


def _witness_line(store: Path, node: str) -> str:
    """What the node's shim saw, summed from its `launches` events in the audit store."""
    from kvguard.daemon.store import Store
    from kvguard.proto import pb

    s = Store(str(store))
    try:
        events = [pb.Event.FromString(b) for _, _, b in s.rows(kind="event", node=f"{node}/shim")]
    finally:
        s.close()
    x = [e.launches for e in events if e.WhichOneof("payload") == "launches"]
    attention, checked, unguarded = (
        sum(getattr(r, f) for r in x) for f in ("attention", "checked", "unguarded")
    )
    steps = max((r.steps for r in x), default=0)
    if not attention:
        return f"{node}: no attention launch seen in {steps} steps"
    verdict = f"all {checked} after a guard check" if checked == attention else f"{unguarded} UNGUARDED"
    return f"{node}: {attention} attention launches in {steps} steps, {verdict}"


class _Indented:
    """Writes through to `out`, three spaces in from the margin."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.fresh = True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            if self.fresh and piece.strip():
                self.out.write("   ")
            self.out.write(piece)
            self.fresh = piece.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    """`kvguard demo`: exit 0 when the leak happened unguarded and was stopped guarded, else 1."""
    if args.top and (no_terminal := _no_terminal()):
        print(f"kvguard demo: --top needs a terminal: {no_terminal}", file=sys.stderr)
        return 2
    if testbed_missing("demo"):
        return 2
    return run_demo(Path(args.out), top=args.top)


def add_parser(sub: Subcommands) -> None:
    """Add `demo` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "demo",
        "the 2026 PD leak on the testbed, unguarded and guarded",
        "Recreate the 2026 prefill/decode leak on two testbed clusters, one unguarded, one guarded.",
        "kvguard demo --out /tmp/kvguard-demo",
    )
    p.add_argument("--out", default="kvguard-demo", help="where the audit captures go")
    p.add_argument("--top", action="store_true", help="watch it on the dashboard (kvguard top); q leaves it")
    p.set_defaults(func=cmd_demo)
