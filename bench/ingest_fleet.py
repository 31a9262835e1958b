"""The ingest benchmark's decode-fleet workload (`bench/ingest.py --fleet NODES,...`): per node a
colocated engine decoding a full batch, one `step` event per forward pass, built as bytes
before timing.

Each node reports its pool, then admits a full batch of requests (admit, alloc of the prompt's
pages, the prefill's write), sent before the clock starts: the engine was already serving.
Every forward pass is one EventBatch (paced, an agent sends every pass due when its last send
was acknowledged in one message, as the node agent's spool does): first the requests that
finished at the last pass (finish, free of all their pages) and the new ones that take their
places in the batch (admit, which gives it its handle, alloc, write of the prompt: their
prefill); then the `step`, as the guard sends it: the batch named by handles, every request
writing its next token (counts all 1, pages each one's last page, slots the valid slots after
the write), and the requests whose token starts a page (every PAGE_SIZE tokens) granted it in
the step itself (`grants`). Reads are not sent: the guard checks them in the engine and sends
only those that fail, the planted stale reads (alloc, read, free of a request of their own,
every --plant-every-th pass as in the page workload). Prompts are 0.5-1.5x --prompt tokens, at
random, so page boundaries do not fall on the same pass for the whole batch; the first batch's
requests have 1..--tokens output tokens left, evenly, so requests finish and are replaced at a
steady rate from the first pass. A pass's `transitions` (what the pacing and the rates count)
are its request-steps: the batch size.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shlex
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
from ingest_drive import Run
from ingest_runs import daemon_run, floor_run
from ingest_workload import PAGE_SIZE, Workload, first_plant

from kvguard.proto import pb, wire


class Node:
    """One node's events as bytes: sequence numbers from 1 without gaps, increasing times."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = 0

    def next(self) -> tuple[int, int]:
        self.seq += 1
        return self.seq, self.seq * 1000

    def event(self, payload: str, **fields: object) -> bytes:
        seq, ts = self.next()
        return pb.Event(node=self.name, seq=seq, ts_ns=ts, **{payload: fields}).SerializeToString()

    def pages(self, kind: str, req: str, pages: list[int], slots: list[int] | None = None) -> bytes:
        """An alloc, write or free, encoded in C as the guard does."""
        seq, ts = self.next()
        s = None if slots is None else np.array(slots, np.int64)
        return wire.encode(kind, self.name, seq, ts, req, 0, np.array(pages, np.int64), s)


def build_node(
    name: str,
    steps: int,
    batch: int,
    tokens: int,
    prompt: int,
    plant_every: int,
    seed: int,
    first_plant: int,
) -> Workload:
    """Node `name`'s `steps` forward passes of a `batch`-request decode batch (see the module's
    docstring); requests write `tokens` output tokens after a prompt of about `prompt`."""
    rng = np.random.default_rng(seed)
    longest = prompt * 3 // 2 + tokens
    pool_pages = batch * (-(-longest // PAGE_SIZE) + 1) * 5 // 4 + 64
    order = rng.permutation(np.arange(1, pool_pages)).tolist()  # page 0 stays out, as SGLang's
    free_pages = deque(order)
    node = Node(name)
    setup = node.event(
        "pool", pool=0, role="colocated", engine="sglang", page_size=PAGE_SIZE, num_pages=pool_pages
    )
    names: list[str] = [""] * batch
    handles = np.zeros(batch, np.int64)  # each slot's request's handle (Admit.handle)
    rounds = np.zeros(batch, np.int64)  # how many requests each slot held
    pages: list[list[int]] = [[] for _ in range(batch)]
    written = np.zeros(batch, np.int64)  # tokens in each request's KV so far
    left = np.zeros(batch, np.int64)  # output tokens still to write
    last = np.zeros(batch, np.int64)  # each request's last page
    serial = 0

    def admit(s: int, out: list[bytes], budget: int) -> None:
        """Slot s takes a new request: admitted, its prompt's pages allocated and written."""
        nonlocal serial
        serial += 1
        req = f"cmpl-{seed:04x}{serial:012x}"
        n = int(rng.integers(prompt // 2, prompt * 3 // 2 + 1))
        got = [free_pages.popleft() for _ in range(-(-n // PAGE_SIZE))]
        slots = [PAGE_SIZE] * (len(got) - 1) + [n - PAGE_SIZE * (len(got) - 1)]
        handles[s] = handle = s + 1 | int(rounds[s] % 4096) << 20  # its slot, a round higher each time
        rounds[s] += 1
        out += [
            node.event(
                "admit", req=req, tenant=f"t{serial % 8}", prompt_tokens=n, stage="prefill", handle=handle
            ),
            node.pages("alloc", req, got),
            node.pages("write", req, got, slots),
        ]
        names[s], pages[s], written[s], left[s], last[s] = req, got, n, budget, got[-1]

    warm: list[bytes] = []
    for s in range(batch):
        admit(s, warm, 1 + s * tokens // batch)
    bodies: list[list[bytes]] = []
    planted: dict[int, str] = {}
    counts = np.ones(batch, np.int64)
    for k in range(steps):
        out: list[bytes] = []
        if plant_every and k >= first_plant and (k - first_plant) % plant_every == 0:
            req = f"{name}-planted{k}"
            page = [free_pages.popleft()]
            read = [{"req": req, "pool": 0, "pages": page, "tokens": PAGE_SIZE}]
            out += [
                node.pages("alloc", req, page),
                node.event("read", reads=read),
                node.pages("free", req, page),
            ]
            free_pages.append(page[0])
            planted[k] = req
        for s in np.flatnonzero(left == 0).tolist():
            out += [
                node.event("finish", req=names[s], output_tokens=tokens),
                node.pages("free", names[s], pages[s]),
            ]
            free_pages.extend(pages[s])
            admit(s, out, tokens)
        crossing = written % PAGE_SIZE == 0
        for s in np.flatnonzero(crossing).tolist():
            page = free_pages.popleft()
            pages[s].append(page)
            last[s] = page
        seq, ts = node.next()
        slots = written % PAGE_SIZE + 1
        # As the guard sends it: the batch by handles, the pass's new pages in the step (grants).
        grants = crossing.astype(np.int64)
        out.append(wire.encode_step(name, seq, ts, 0, 0, handles, counts, last, slots, grants))
        written += 1
        left -= 1
        bodies.append(out)
    return Workload(name, setup, [], bodies, [batch] * steps, planted, warm)


# ---------------------------------------------------------------------------- runs and report

GOAL_STEPS = 1_000_000  # request-steps per second, sustained through one daemon
GOAL_P99_MS = 10.0  # event-to-alert at that rate
FLEET_HEADER = (
    f"{'batch':>5} {'nodes':>5} {'run':>11} {'steps/s':>8} {'events/s':>9} {'M req-steps/s':>13} "
    f"{'floor M/s':>9} {'ratio':>6} {'alert p50':>9} {'alert p99':>9} {'alerts':>6} {'ack p50':>8} "
    f"{'ack p99':>8} {'daemon µs/pass':>14} {'writer µs/pass':>14} {'client µs/pass':>14} {'idle':>5} "
    f"{'steal':>5} {'store MB':>8}"
)


def ms(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1e3:.2f}" if values else "-"


def fleet_row(batch: int, nodes: int, label: str, run: Run, floor: Run | None, db: int) -> str:
    """A run's row: its rates (request-steps, forward passes and events a second), beside the
    floor's where there is one, its latencies (ms), the daemon's and its writer's CPU a pass."""
    steps = run.transitions / batch  # forward passes sent
    cpu = {k: f"{v / steps * 1e6:.0f}" if steps else "-" for k, v in run.cpu.items()}
    ratio = f"{run.rate / floor.rate:.3f}" if floor and floor.rate else "-"
    floor_rate = f"{floor.rate / 1e6:.3f}" if floor else "-"
    return (
        f"{batch:>5} {nodes:>5} {label:>11} {steps / run.elapsed if run.elapsed else 0:>8.0f} "
        f"{run.event_rate:>9.0f} {run.rate / 1e6:>13.3f} {floor_rate:>9} {ratio:>6} {ms(run.alerts, 50):>9} "
        f"{ms(run.alerts, 99):>9} {len(run.alerts):>6} {ms(run.acks, 50):>8} {ms(run.acks, 99):>8} "
        f"{cpu.get('daemon', '-'):>14} {cpu.get('writer', '-'):>14} {cpu.get('client', '-'):>14} "
        f"{run.machine.get('idle', 0):>5.0%} {run.machine.get('steal', 0):>5.1%} {db / 1e6:>8.1f}"
    )


def measure_fleet(args: argparse.Namespace, wakes: list[str]) -> int:
    """Every (batch, nodes) of --batch and --fleet: closed loop against the daemon and the
    floor, then paced at --steps-per-s a node, --repeat times; the table, and the goal judged
    on the paced runs of the largest. The number of runs with errors."""
    fleets = [int(n) for n in args.fleet.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    rows: list[str] = []
    paced: list[tuple[int, int, float, str, Run]] = []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as tmp:
        store_dir = args.store_dir or Path(tmp)
        store_dir.mkdir(parents=True, exist_ok=True)
        for batch, nodes in itertools.product(batches, fleets):
            steps = int(args.seconds * args.steps_per_s * 2.5) + 1  # the closed loop may run 2x faster
            built = time.perf_counter()
            workloads = [
                build_node(
                    f"n{k}",
                    steps,
                    batch,
                    args.tokens,
                    args.prompt,
                    args.plant_every,
                    k,
                    first_plant(k, args.plant_every, args.plant_lockstep),
                )
                for k in range(nodes)
            ]
            gc.collect()
            gc.freeze()
            built = time.perf_counter() - built
            tag = f"fleet{batch}-{nodes}-{os.getpid()}"
            offered = nodes * batch * args.steps_per_s
            print(
                f"batch {batch}, {nodes} nodes: {steps} passes a node built in {built:.1f} s "
                f"({sum(len(b) for w in workloads for b in w.bodies) / (steps * nodes):.1f} events a pass)",
                flush=True,
            )
            done: list[tuple[str, Run, Run | None, int]] = []
            if not args.fleet_paced_only:
                daemon, db = daemon_run(
                    workloads, args.seconds, store_dir, tag, args.py_spy, client=args.client
                )
                floor = floor_run(workloads, args.seconds, store_dir, tag, args.client)
                done += [("closed", daemon, floor, db), ("floor", floor, None, 0)]
            for repeat, wake in itertools.product(range(args.repeat), wakes):
                run, db = daemon_run(
                    workloads,
                    args.seconds,
                    store_dir,
                    f"{tag}-paced-{repeat}-wake{wake or 'off'}",
                    args.py_spy,
                    offered,
                    client=args.client,
                    wake=wake,
                )
                done.append((f"@{offered / 1e6:.3g}M{f' w{wake}' if wake else ''}", run, None, db))
                paced.append((batch, nodes, offered, wake, run))
            for label, run, floor, db in done:
                rows.append(fleet_row(batch, nodes, label, run, floor, db))
                print(f"  {label}: {run.events} events in {run.elapsed:.1f} s", flush=True)
                for error in run.errors:
                    print(f"  ERROR ({label}): {error}", flush=True)
                failed += bool(run.errors)
            del workloads
            gc.unfreeze()
            gc.collect()
    print()
    print(FLEET_HEADER)
    print(*rows, sep="\n")
    print(f"command: python bench/ingest.py {shlex.join(sys.argv[1:])}".rstrip())
    print(
        "a pass: one forward of a node's batch, one EventBatch (the step, its allocs, the requests that "
        "finished and those admitted);\nrates: request-steps/s = passes/s x batch; closed: each node sends "
        "its next pass when the last is acknowledged; @: paced at --steps-per-s a node, the passes due "
        "when the last was acknowledged sent in one message (as the node agent does), latency from the "
        "scheduled send;\nfloor: the closed loop against a server that acknowledges without looking (gRPC, "
        "protobuf and this client);\nµs/pass: CPU of the daemon's process, of its store writer and of the "
        "agents (this process) a forward pass; idle, steal: the machine's CPU time meanwhile"
    )
    for batch, nodes, offered, wake, run in paced:
        p99 = float(np.percentile(run.alerts, 99)) * 1e3 if run.alerts else float("inf")
        kept = run.rate >= 0.98 * offered
        verdict = "yes" if kept and p99 < GOAL_P99_MS else "NO"
        goal = " (the goal)" if offered >= 0.99 * GOAL_STEPS else ""
        print(
            f"p99 event-to-alert < {GOAL_P99_MS:g} ms at {offered / 1e6:.3g} M request-steps/s offered "
            f"(batch {batch}, {nodes} nodes{f', daemon --cpu-latency-us {wake}' if wake else ''}): "
            f"{verdict} ({run.rate / 1e6:.3f} M/s kept up, p99 {p99:.2f} ms, "
            f"{run.machine.get('steal', 0):.1%} stolen){goal}"
        )
        said = ", ".join(f"{stage} {p50:.2f}/{p99:.2f}" for stage, (p50, p99, _) in run.stages.items())
        print(f"  the daemon's own time, receipt of a batch to each step, p50/p99 ms: {said}")
    return failed
