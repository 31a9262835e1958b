"""Decodes what a process wrote to its TCP connections, as the eBPF witness saw it, into the
KV transfers they carried. Pure: (length, first bytes) of each write in, reports out.

The framing is kvguard's KV transfer framing (proto/transfer.py): a header (JSON length,
payload length), a JSON object, the payload; a transfer is a message whose JSON names it.
Invariants: every payload byte of a transfer counts once, toward the transfer its header
named; a transfer is reported when its payload ends or its connection closes (`complete`:
the probe saw its end); a connection whose bytes cannot be followed (a header outside the
captured head, events lost) is marked lost and reports nothing more until it is opened
again: never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.proto.transfer import HEADER, MAX_JSON, MAX_PAYLOAD, transfer_of

PROBE = "ebpf:tcp"
JSON_KEPT = 4096  # bytes of a message's JSON kept to find its xfer (the head of each write is captured)


@dataclass(frozen=True, slots=True)
class RemoteWrites:
    """Where one transfer's RDMA writes went in the peer's memory, as the sender posted them."""

    lo: int  # the lowest remote address written, and one past the highest
    hi: int
    runs: tuple[tuple[int, int], ...]  # (address, bytes) of each write, adjacent ones merged, in order
    lost: int  # writes beyond the runs the probe keeps: `runs` is then a part of them
    first_ns: int  # wall clock: when the first post with writes began (none landed before)
    last_ns: int


@dataclass(frozen=True, slots=True)
class WireReport:
    """Bytes of one transfer as a probe saw the process move them (here: the payload it wrote
    to a connection; the witness's CUDA probes report the copies off the device the same way)."""

    pid: int
    xfer: str
    bytes: int
    calls: int  # writes that carried them
    complete: bool  # the transfer's payload ended, or its connection closed
    probe: str = PROBE
    remote: RemoteWrites | None = None  # RDMA probes: where its writes landed


@dataclass
class Connection:
    """One connection's byte stream: where in the current message its next byte falls."""

    pid: int
    state: str = "header"  # header, json, payload, lost
    header: bytearray = field(default_factory=bytearray)
    json: bytearray = field(default_factory=bytearray)
    left: int = 0  # bytes left in the current part (json or payload)
    payload: int = 0  # payload length the header announced
    xfer: str = ""
    seen: int = 0  # payload bytes of the current message so far
    calls: int = 0
    json_length: int = 0
    unnamed: int = 0  # messages whose JSON was not all captured and named no transfer in what was

    def write(self, length: int, head: bytes) -> list[WireReport]:
        """`length` bytes written, of which `head` are the first (the rest were not captured)."""
        reports: list[WireReport] = []
        pos = 0
        while pos < length and self.state != "lost":
            if self.state == "header":
                take = min(HEADER.size - len(self.header), length - pos)
                if pos + take > len(head):
                    self.state = "lost"  # a message starts beyond the captured bytes
                    break
                self.header += head[pos : pos + take]
                pos += take
                if len(self.header) == HEADER.size:
                    n_json, self.payload = HEADER.unpack(self.header)
                    if n_json > MAX_JSON or self.payload > MAX_PAYLOAD:
                        self.state = "lost"  # not this framing
                        break
                    self.state, self.left, self.json_length = "json", n_json, n_json
            elif self.state == "json":
                take = min(self.left, length - pos)
                room = JSON_KEPT - len(self.json)
                self.json += head[pos : pos + min(take, room)]
                pos += take
                self.left -= take
                if self.left == 0:
                    self.xfer = transfer_of(bytes(self.json))
                    if not self.xfer and len(self.json) < self.json_length:
                        self.unnamed += 1  # it may have been a transfer: followed, not reported
                    self.state, self.left = "payload", self.payload
                    self.seen = self.calls = 0
                    if self.payload == 0:
                        reports += self._end()
            else:  # payload
                take = min(self.left, length - pos)
                pos += take
                self.left -= take
                self.seen += take
                self.calls += 1
                if self.left == 0:
                    reports += self._end()
        return reports

    def close(self) -> list[WireReport]:
        """The connection closed: a transfer cut short ends with what was written."""
        return self._report() if self.state == "payload" else []

    def _end(self) -> list[WireReport]:
        reports = self._report()
        self.state, self.xfer = "header", ""
        self.header.clear()
        self.json.clear()
        return reports

    def _report(self) -> list[WireReport]:
        if not self.xfer:
            return []
        return [WireReport(self.pid, self.xfer, self.seen, self.calls, complete=True)]


class Streams:
    """Every watched connection, by (pid, fd). Counts what it could not follow."""

    def __init__(self) -> None:
        self.connections: dict[tuple[int, int], Connection] = {}
        self.lost = 0  # connections given up on
        self.unnamed = 0  # messages that may have been transfers, their names not captured

    def open(self, pid: int, fd: int) -> list[WireReport]:
        """A new connection on fd (connect or accept): whatever was there before has ended."""
        reports = self.close(pid, fd)
        self.connections[(pid, fd)] = Connection(pid)
        return reports

    def write(self, pid: int, fd: int, length: int, head: bytes) -> list[WireReport]:
        if length <= 0:
            return []
        conn = self.connections.get((pid, fd))
        if conn is None:  # opened before the witness watched: its message boundaries are unknown
            conn = self.connections[(pid, fd)] = Connection(pid, state="lost")
            self.lost += 1
        was_lost, unnamed = conn.state == "lost", conn.unnamed
        reports = conn.write(length, head)
        self.unnamed += conn.unnamed - unnamed
        if conn.state == "lost" and not was_lost:
            self.lost += 1
        return reports

    def close(self, pid: int, fd: int) -> list[WireReport]:
        conn = self.connections.pop((pid, fd), None)
        return conn.close() if conn is not None else []

    def forget(self, pid: int) -> None:
        """The process is no longer watched."""
        for key in [k for k in self.connections if k[0] == pid]:
            del self.connections[key]

    def lose_all(self) -> None:
        """Events were lost: no connection's position is certain any more."""
        for conn in self.connections.values():
            if conn.state != "lost":
                conn.state = "lost"
                self.lost += 1
