"""A damaged spool file (issue 26): bad bytes, a corrupt length, a torn write, a spool of the
earlier format. The agent starts, sets the damage aside (counted, said with its offset) and
replays every whole record, to a real daemon."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
from agent_helpers import stored, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.agents.spool import Source, Spool
from kvguard.agents.spool_file import MAGIC, record
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import pb


def event(seq: int, size: int = 1) -> bytes:
    """d0's event `seq` (its pool first, heartbeats after), about `size` bytes more or less."""
    if seq == 1:
        return pb.Event(
            node="d0", seq=1, pool=pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=64)
        ).SerializeToString()
    return pb.Event(node="d0", seq=seq, heartbeat=pb.Heartbeat(agent_version="v" * size)).SerializeToString()


def spooled(directory: Path, bodies: list[bytes]) -> Path:
    """A spool file of d0 holding these events, as the agent writes it."""
    directory.mkdir(exist_ok=True)
    spool = Spool(directory, "d0")
    spool.append(bodies, [(0, pb.Event.FromString(b).seq) for b in bodies])
    spool.close()
    return directory / "d0.spool"


def offsets(bodies: list[bytes]) -> list[int]:
    """Where each event's record begins in the spool file, and where the file ends."""
    out = [0]
    for body in bodies:
        out.append(out[-1] + len(record(body)))
    return out


def test_a_damaged_spool_is_set_aside_and_the_rest_replayed(tmp_path: Path) -> None:
    # Ten events wait in the spool; the third's length is corrupt and the sixth has bad bytes.
    # Before: a corrupt length dropped every event after it, silently. Now the agent starts,
    # sets both records aside beside the spool, says where, and the daemon gets the other 8.
    bodies = [event(seq, size=seq) for seq in range(1, 11)]
    path = spooled(tmp_path / "spool", bodies)
    at = offsets(bodies)
    data = bytearray(path.read_bytes())
    data[at[2] + 4 : at[2] + 8] = struct.pack(">I", 1 << 30)  # the third record's length
    data[at[5] + 14] ^= 0xFF  # a byte of the sixth's body
    path.write_bytes(bytes(data))
    daemon = start_daemon(str(tmp_path / "audit.db"))
    agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
    try:
        assert wait_for(lambda: [e.seq for e in stored(daemon.store)] == [1, 2, 4, 5, 7, 8, 9, 10])
        assert wait_for(lambda: path.stat().st_size == 0)  # all delivered: nothing left to resend
    finally:
        log = agent.stop()
        daemon.stop()
    aside = (tmp_path / "spool" / "d0.damaged").read_bytes()
    assert bytes(data[at[2] : at[3]]) in aside and bytes(data[at[5] : at[6]]) in aside
    said = [line for line in log.splitlines() if "set aside in" in line]
    assert len(said) == 2
    assert f"{at[3] - at[2]} bytes at offset {at[2]} set aside" in said[0]
    assert "a record of 1073741824 bytes runs past the end of the file" in said[0]
    assert "checksum does not match (bad bytes, or a corrupt length)" in said[1]
    assert f"{at[6] - at[5]} bytes at offset {at[5]} set aside" in said[1]
    assert "spool_set_aside=2" in log.splitlines()[-1]


def legacy(bodies: list[bytes]) -> bytes:
    """A spool file of the earlier format: each event as its length and its bytes."""
    return b"".join(struct.pack(">I", len(b)) + b for b in bodies)


def test_a_spool_of_the_earlier_format_is_read_and_written_anew(tmp_path: Path) -> None:
    bodies = [event(seq) for seq in range(1, 6)]
    stray = b"\x01\x02not an event"  # whole, but no event of d0: set aside alone
    (tmp_path / "d0.spool").write_bytes(legacy(bodies[:2]) + legacy([stray]) + legacy(bodies[2:]))
    spool = Spool(tmp_path, "d0")
    assert (list(spool.bodies), spool.set_aside) == (bodies, 1)
    spool.append([event(6)], [(0, 6)])
    spool.close()
    assert (tmp_path / "d0.spool").read_bytes()[:4] == MAGIC  # in the current format now
    again = Spool(tmp_path, "d0")
    assert (list(again.bodies), again.set_aside) == ([*bodies, event(6)], 0)
    again.close()
    assert stray in (tmp_path / "d0.damaged").read_bytes()


# ---------------------------------------------------------------------------------- fuzzing

DAMAGE = st.one_of(
    st.tuples(st.just("overwrite"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=24)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(b"")),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=24)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=24)),
    st.tuples(
        st.just("length"),
        st.integers(0, 1 << 16),
        st.integers(0, (1 << 32) - 1).map(struct.Struct(">I").pack),
    ),
)


def damage(data: bytes, kind: str, where: int, value: bytes) -> tuple[bytes, int, int]:
    """The data damaged, and the stretch [start, end) of the original bytes it touched."""
    where %= len(data) + 1
    if kind == "length":  # a record's length field, rewritten
        where = data.rfind(MAGIC, 0, where + 1) + 4 if data.rfind(MAGIC, 0, where + 1) >= 0 else 4
        return data[:where] + value + data[where + 4 :], where, where + 4
    if kind == "overwrite":
        return data[:where] + value + data[where + len(value) :], where, where + len(value)
    if kind == "truncate":
        return data[:where], where, len(data)
    if kind == "insert":
        return data[:where] + value + data[where:], where, where
    return data[:where] + data[where + len(value) :], where, where + len(value)  # delete


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    hurt=DAMAGE,
    earlier=st.booleans(),
)
def test_a_spool_file_survives_any_damage(tmp_path_factory, sizes: list[int], hurt, earlier: bool) -> None:  # type: ignore[no-untyped-def]
    # Any one damage to a spool file (bytes overwritten, inserted, deleted, a length rewritten,
    # the file cut short), in the current format or the earlier one: reading never raises and
    # keeps only events that were spooled, in order; every record the damage did not touch is
    # kept (in the earlier format, which has no markers to resume at: those before it); the
    # file is then whole again: appendable, and read back the same.
    directory = tmp_path_factory.mktemp("spool")
    bodies = [event(seq, size) for seq, size in enumerate(sizes, 1)]
    if earlier:
        original = legacy(bodies)
        at = [0]
        for body in bodies:
            at.append(at[-1] + 4 + len(body))
    else:
        original = spooled(directory, bodies).read_bytes()
        at = offsets(bodies)
    data, start, end = damage(original, *hurt)
    (directory / "d0.spool").write_bytes(data)
    spool = Spool(directory, "d0")
    kept = list(spool.bodies)
    if earlier:  # no markers, no checksums: the records before the damage, then events of d0
        before = [b for i, b in enumerate(bodies) if at[i + 1] <= start]
        assert kept[: len(before)] == before
        assert all(pb.Event.FromString(k).node == "d0" for k in kept)
    else:
        untouched = [b for i, b in enumerate(bodies) if at[i + 1] <= start or at[i] >= end]
        it = iter(kept)
        assert all(any(k == b for k in it) for b in untouched)  # each untouched one kept, in order
        it = iter(bodies)
        assert all(any(k == b for b in it) for k in kept)  # only spooled events, in order
    assert list(spool.pending) == [(0, pb.Event.FromString(b).seq) for b in kept]
    assert spool.set_aside == 0 or data != original
    spool.append([event(99)], [(0, 99)])
    spool.close()
    again = Spool(directory, "d0")
    assert (list(again.bodies), again.set_aside) == ([*kept, event(99)], 0)
    again.close()


@pytest.mark.parametrize("kept", ["", "12x", "-3", "99999999999999999999999"])
def test_a_damaged_number_file_never_makes_a_number_be_used_twice(tmp_path: Path, kept: str) -> None:
    spool = Spool(tmp_path, "n0/probe")
    source = Source(spool, tmp_path, "n0/probe")
    source.emit(heartbeat=pb.Heartbeat())
    (tmp_path / "n0%2Fprobe.seq").write_text(kept)
    again = Source(spool, tmp_path, "n0/probe")
    again.emit(heartbeat=pb.Heartbeat())
    spool.close()
    assert again._seq > time.time_ns() // 1000 - 60_000_000  # from the clock, past any number used
