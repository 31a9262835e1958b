"""The alert subscriber (`bench/ingest.py --subscribe`, a process of its own), this process's
reader of it (Alerts), and the probe that warms the daemon's alert path before timing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from ingest_workload import CHANNEL_OPTIONS, ENTRY, PAGE_SIZE, PLANTED

from kvguard.agents.upstream import AgentStream
from kvguard.proto.builder import EventLog
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

# The subscriber is part of the measurement, not of the daemon under test: it imports kvguard
# as this process did (bench/ab_ingest.py points PYTHONPATH at another daemon afterwards).
MEASURING_ENV = dict(os.environ)


class Alerts:
    """The alert subscriber, as a SIEM would run it: a process of its own (`bench/ingest.py
    --subscribe ADDR`) holding an AlertService.Subscribe stream, so its arrival times do not
    wait for this process's GIL. It prints `<perf_counter> <req>` per alert; perf_counter is
    CLOCK_MONOTONIC, the same clock in every process of the machine."""

    def __init__(self, address: str) -> None:
        self.arrived: dict[str, float] = {}
        self.steal: list[tuple[float, float]] = []  # the samples around each rise of stolen time
        self.others = 0
        self.cond = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, ENTRY, "--subscribe", address],
            stdout=subprocess.PIPE,
            text=True,
            env=MEASURING_ENV,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            at, req = line.split()
            if at == "steal":  # from the subscriber's watch
                before, seen = req.split(":")
                self.steal.append((float(before), float(seen)))
                continue
            with self.cond:
                if req in self.arrived:
                    self.others += 1
                self.arrived[req] = float(at)
                self.cond.notify_all()

    def stolen_spans(self) -> list[tuple[float, float]]:
        """Where CPU time was stolen: for each rise of the machine's steal count, from a clock
        tick (the count's unit) before the sample before it to the sample that saw it."""
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        return [(before - tick, seen) for before, seen in self.steal]

    def wait_for(self, reqs: list[str], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: all(r in self.arrived for r in reqs), timeout)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.thread.join(5)


STEAL_SAMPLE_S = 0.002  # how often the subscriber reads the machine's stolen CPU time


def subscriber(address: str) -> None:
    """`bench/ingest.py --subscribe ADDR`: print each planted alert's arrival time, and each
    rise of the machine's CPU time stolen by the hypervisor (/proc/stat, all CPUs), read every
    STEAL_SAMPLE_S by a thread (~1 % of a core): `steal <the sample before>:<the one that saw it>`."""
    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def watch_steal() -> None:
        fd = os.open("/proc/stat", os.O_RDONLY)
        before, last = time.perf_counter(), -1
        while True:
            now = time.perf_counter()
            ticks = int(os.pread(fd, 256, 0).split(b"\n", 1)[0].split()[8])  # cpu: user, ..., steal
            if 0 <= last < ticks:
                say(f"steal {before!r}:{now!r}")
            before, last = now, ticks
            time.sleep(STEAL_SAMPLE_S)

    threading.Thread(target=watch_steal, daemon=True).start()
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter(findings=[PLANTED]))
        signal.signal(signal.SIGTERM, lambda *_: call.cancel())
        with contextlib.suppress(grpc.RpcError):
            for alert in call:
                say(f"{time.perf_counter()!r} {alert.finding.req}")


def probe(address: str, alerts: Alerts) -> None:
    """A planted fault on a node of its own, sent before timing: the subscription is live and
    the daemon's paths are warm when the clock starts."""
    log = EventLog()
    log.add("probe", "pool", pool=0, role="colocated", page_size=PAGE_SIZE, num_pages=64)
    log.add("probe", "alloc", req="probe-planted", pool=0, pages=[1])
    log.add("probe", "read", reads=[{"req": "probe-planted", "pool": 0, "pages": [1], "tokens": PAGE_SIZE}])
    log.add("probe", "free", req="probe-planted", pool=0, pages=[1])
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stream = AgentStream(channel, "probe", "kvguard-bench")
        stream.send(log.events)
        stream.close()
    if not alerts.wait_for(["probe-planted"], 30):
        raise SystemExit("the probe's planted stale_read raised no alert within 30 s")
