"""A spool file's records, and reading them back whatever happened to the file.

A record is MAGIC (4 bytes), the body's length (4 bytes, big-endian), a CRC-32 of the length
and the body (4 bytes), then the body: one event's bytes as the guard sent them.

Invariant: reading a file keeps every whole record, in order, and sets every other byte
aside, none lost: a damaged stretch (bad bytes, a corrupt length, a torn last write) is
appended to the `.damaged` file beside the spool, said on one line with its offset and
counted, and reading resumes at the next whole record. A spool of the earlier format (each
event as its length and its bytes, no marker) is read too, each record checked as an event of
the spool's node (there is no checksum to tell more), and is then written again in this one;
a file is of the earlier format when it holds no whole record of this one.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from kvguard.proto import pb, wire
from kvguard.proto.logs import logger

log = logger("agent")

MAGIC = b"\xffKVS"
_HEAD = struct.Struct(">4sII")  # MAGIC, length, CRC-32 of the length's 4 bytes and the body
_LEN = struct.Struct(">I")
Position = tuple[int, int]  # (epoch, seq): where an event lies in its node's stream


def record(body: bytes) -> bytes:
    """One event's bytes as a record of the spool file."""
    length = _LEN.pack(len(body))
    return MAGIC + length + _LEN.pack(zlib.crc32(body, zlib.crc32(length))) + body


@dataclass
class Found:
    """What a spool file holds: its events (bytes and position) and how many damaged
    stretches were set aside; `rewrite`: the file should be written again (damaged, or of the
    earlier format), so that new records are appended after whole ones."""

    events: list[tuple[bytes, Position]] = field(default_factory=list)
    set_aside: int = 0
    rewrite: bool = False


def read_records(path: Path, node: str) -> Found:
    """The events of the spool file at `path` (of node `node`), damaged stretches set aside."""
    data = path.read_bytes()
    found = Found()
    damaged: list[tuple[int, int, str]] = []  # (offset, end, why)
    if data and _next_whole(data, 0) == len(data) and data[:4] != MAGIC:  # not one record of ours
        _read_earlier(data, node, found, damaged)
        found.rewrite = True
        log.info(f"spool {path} is of the earlier format: read, written anew")
    else:
        offset = 0
        while offset < len(data):
            end, why = _whole(data, offset)
            if end:
                body = data[offset + _HEAD.size : end]
                found.events.append((body, wire.single(body).position(0)))
                offset = end
                continue
            resume = _next_whole(data, offset + 1)
            damaged.append((offset, resume, why))
            offset = resume
    if damaged:
        _set_aside(path, data, damaged)
        found.set_aside = len(damaged)
        found.rewrite = True
    return found


def _whole(data: bytes, offset: int) -> tuple[int, str]:
    """The end of the whole record at `offset`; or 0, and why there is none."""
    if len(data) - offset < _HEAD.size:
        return 0, "a record cut short (a torn write)"
    magic, n, crc = _HEAD.unpack_from(data, offset)
    if magic != MAGIC:
        return 0, "bytes that are no record"
    end = offset + _HEAD.size + n
    if end > len(data):
        return 0, f"a record of {n} bytes runs past the end of the file (a torn write, or a corrupt length)"
    if zlib.crc32(data[offset + _HEAD.size : end], zlib.crc32(data[offset + 4 : offset + 8])) != crc:
        return 0, "a record whose checksum does not match (bad bytes, or a corrupt length)"
    return end, ""


def _next_whole(data: bytes, start: int) -> int:
    """Where the next whole record at or after `start` begins (the end of data if none)."""
    while (at := data.find(MAGIC, start)) >= 0:
        if _whole(data, at)[0]:
            return at
        start = at + 1
    return len(data)


def _read_earlier(data: bytes, node: str, found: Found, damaged: list[tuple[int, int, str]]) -> None:
    """Records of the earlier format: no marker to resume at, so a length that runs past the
    end sets the rest aside; a record that is no event of `node` is set aside alone."""
    offset = 0
    while offset < len(data):
        if len(data) - offset < _LEN.size:
            damaged.append((offset, len(data), "a record cut short (a torn write)"))
            return
        (n,) = _LEN.unpack_from(data, offset)
        end = offset + _LEN.size + n
        if end > len(data):
            why = f"a record of {n} bytes runs past the end of the file (a torn write, or a corrupt length)"
            damaged.append((offset, len(data), why))
            return
        body = data[offset + _LEN.size : end]
        if _is_event_of(body, node):
            found.events.append((body, wire.single(body).position(0)))
        else:
            damaged.append((offset, end, f"a record that is no event of node {node}"))
        offset = end


def _is_event_of(body: bytes, node: str) -> bool:
    try:
        return pb.Event.FromString(body).node == node
    except DecodeError:
        return False


def _set_aside(path: Path, data: bytes, damaged: list[tuple[int, int, str]]) -> None:
    """Append the damaged stretches to the `.damaged` file beside the spool, each after a
    line that says where it was and why, and say each on one line."""
    aside = path.with_suffix(".damaged")
    with aside.open("ab") as out:
        for offset, end, why in damaged:
            out.write(f"# {path.name} offset {offset}, {end - offset} bytes: {why}\n".encode())
            out.write(data[offset:end] + b"\n")
            log.warning(f"spool {path}: {end - offset} bytes at offset {offset} set aside in {aside}: {why}")
        out.flush()
        os.fsync(out.fileno())
