"""The processes of a run: the daemon as deployed or the floor server, started and stopped,
the daemon's own count and CPU, the machine's stolen time; one run against either."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from ingest_alerts import Alerts, probe
from ingest_drive import Run, drive, drive_aio
from ingest_workload import CHANNEL_OPTIONS, ENTRY, PLANTED, Workload

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


class FloorServicer(svc_grpc.AgentServiceServicer):
    """The same AgentService.Stream, acknowledging each batch at once and doing nothing else."""

    def Stream(self, request_iterator: Iterator[svc.AgentMessage], context: grpc.ServicerContext) -> Any:
        node = ""
        for msg in request_iterator:
            if msg.WhichOneof("body") == "hello":
                node = msg.hello.node
                yield svc.DaemonMessage(ack=svc.Ack(node=node))
            else:
                events = msg.batch.events
                n = len(events)
                yield svc.DaemonMessage(
                    ack=svc.Ack(node=node, accepted=n, durable_seq=events[n - 1].seq if n else 0)
                )


def floor_server() -> None:
    """`bench/ingest.py --floor-server`: serve the floor on a free port, print READY <port>."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=CHANNEL_OPTIONS)
    svc_grpc.add_AgentServiceServicer_to_server(FloorServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=1).wait()


@dataclass
class Process:
    proc: subprocess.Popen[str]
    port: int
    target: int  # the pid to signal (the server itself, also when py-spy runs it)
    log: Path


def start(cmd: list[str], log: Path, timeout: float = 60.0) -> Process:
    """Start a server that prints READY <port> on stdout."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.startswith("READY "):
            break
    if not line.startswith("READY "):
        proc.kill()
        raise SystemExit(f"{shlex.join(cmd)} did not start:\n{log.read_text()}")
    target = proc.pid
    if cmd[0].endswith("py-spy"):  # the server is py-spy's child
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        target = int(children[0])
    return Process(proc, int(line.split()[1]), target, log)


def stop(p: Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.target, signal.SIGTERM)
    try:
        p.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        p.proc.wait()


def fleet_check(address: str, run: Run) -> None:
    """The daemon's own count: every event stored, one finding per planted fault, no other."""
    with grpc.insecure_channel(address) as channel:
        state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=30)
    run.stages = {s.stage: (s.p50_ms, s.p99_ms, s.max_ms) for s in state.latencies}
    expected_events = run.events + run.setup + 4  # + the probe's
    findings = dict(state.findings)
    if state.events != expected_events:
        run.errors.append(f"daemon counts {state.events} events, the agents had {expected_events} acked")
    if findings != {PLANTED: run.planted_sent + 1}:
        run.errors.append(f"daemon findings {findings}, expected {{{PLANTED!r}: {run.planted_sent + 1}}}")


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time used so far by the daemon's process and by its children (the store writer):
    far steadier from run to run than latency on a shared machine."""
    tick = os.sysconf("SC_CLK_TCK")

    def of(p: int) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    children = [
        int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()
    ]
    return {"daemon": of(pid), "writer": sum(of(c) for c in children)}


def machine_ticks() -> dict[str, int]:
    """The machine's CPU time so far by kind (/proc/stat, clock ticks, all CPUs)."""
    kinds = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return dict(zip(kinds, map(int, fields), strict=False))


def machine_share(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Stolen and idle shares of the machine's CPU time between two machine_ticks()."""
    spent = {k: after[k] - before[k] for k in before}
    total = sum(spent.values())
    return {k: spent[k] / total for k in ("steal", "idle")} if total else {}


def daemon_run(
    workloads: list[Workload],
    seconds: float,
    store_dir: Path,
    tag: str,
    spy: Path | None,
    paced: float = 0.0,
    as_agent: bool = False,
    client: str = "aio",
    wake: str = "",
    attach: Callable[[str], Callable[[], None]] | None = None,
) -> tuple[Run, int]:
    """One run against a fresh daemon; `wake`: its --cpu-latency-us ("": none given);
    `attach(address)` starts another client of the daemon for the run (a dashboard) and
    returns what stops it."""
    store = store_dir / f"ingest-{tag}.db"
    cmd = [sys.executable, "-m", "kvguard", "daemon", "--listen", "127.0.0.1:0", "--store", str(store)]
    if wake:
        cmd += ["--cpu-latency-us", wake]
    if spy is not None:
        py_spy = Path(sys.executable).with_name("py-spy")
        spy.mkdir(parents=True, exist_ok=True)
        out = spy / f"daemon-{tag}.txt"
        cmd = [
            str(py_spy),
            "record",
            "--nonblocking",
            "--gil",
            "--subprocesses",
            "--format",
            "raw",
            "-o",
            str(out),
            "--",
            *cmd,
        ]
    daemon = start(cmd, store_dir / f"daemon-{tag}.log")
    address = f"127.0.0.1:{daemon.port}"
    try:
        alerts = Alerts(address)
        detach = None
        try:
            probe(address, alerts)
            if attach is not None:
                detach = attach(address)
            before: dict[str, float] = {}
            ticks: dict[str, int] = {}

            def on_start() -> None:  # the CPU the run uses, not its streams' opening (a fleet's: its batch)
                before.update(cpu_seconds(daemon.target))
                ticks.update(machine_ticks())

            if as_agent or client == "threads":
                run = drive(address, workloads, seconds, alerts, paced, as_agent, on_start)
            else:
                run = drive_aio(address, workloads, seconds, alerts, paced, on_start)
            used = {k: v - before[k] for k, v in cpu_seconds(daemon.target).items()}
            run.cpu = used | run.cpu
            run.machine = machine_share(ticks, machine_ticks())
        finally:
            if detach is not None:
                detach()
            alerts.close()
        fleet_check(address, run)
    finally:
        stop(daemon)
    return run, store.stat().st_size


def floor_run(
    workloads: list[Workload], seconds: float, store_dir: Path, tag: str, client: str = "aio"
) -> Run:
    server = start([sys.executable, ENTRY, "--floor-server"], store_dir / f"floor-{tag}.log")
    try:
        address = f"127.0.0.1:{server.port}"
        if client == "threads":
            return drive(address, workloads, seconds, None)
        return drive_aio(address, workloads, seconds, None)
    finally:
        stop(server)
