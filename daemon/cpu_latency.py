"""How long an idle CPU may take to wake up, held for the daemon's lifetime (Linux PM QoS).

An idle CPU sleeps in the deepest idle state its wake-up bound allows. In a VM whose idle vCPUs
halt to the host (KVM haltpoll with guest polling off, as on Firecracker), every wake-up of an
idle vCPU is a VM exit and then a wait for the host to run that vCPU again, which the guest
counts as stolen time: an alert crosses four processes (agent, daemon, store writer,
subscriber), and each hop may pay it. A bound of 0 µs leaves the idle CPUs only the polling
state: they spin instead of halting (the cores look fully busy to the host, or draw power on
bare metal), so that cost is an operator's choice (`kvguard daemon --cpu-latency-us`). On bare
metal a few µs to tens of µs keeps the shallow idle states and forbids the deep ones.

Invariant: the bound holds exactly while the descriptor `hold()` returns is open; the kernel
drops it when the daemon's process exits, however it exits.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

DEVICE = Path("/dev/cpu_dma_latency")  # the kernel's CPU latency request, one per open descriptor
MAX_US = 2_000_000_000  # the kernel's default: no bound


class CpuLatencyError(Exception):
    """The bound could not be held (not Linux, no PM QoS, no permission)."""


def hold(us: int, device: Path | None = None) -> int:
    """Ask that no CPU take more than `us` µs to wake up, until the returned descriptor is
    closed (the daemon keeps it open for its lifetime). `device`: DEVICE."""
    device = device or DEVICE
    if not 0 <= us <= MAX_US:
        raise CpuLatencyError(f"CPU wake-up latency {us} µs is not between 0 and {MAX_US}")
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CpuLatencyError(
            f"CPU wake-up latency {us} µs: cannot open {device}: {exc.strerror} "
            "(it takes root, or write access to that device, on Linux)"
        ) from None
    try:
        os.write(fd, struct.pack("=i", us))
    except OSError as exc:
        os.close(fd)
        raise CpuLatencyError(f"CPU wake-up latency {us} µs: {device} refused it: {exc.strerror}") from None
    return fd


def current(device: Path | None = None) -> int:
    """The bound in force now, over every holder (MAX_US: none)."""
    with open(device or DEVICE, "rb") as f:
        return int(struct.unpack("=i", f.read(4))[0])
