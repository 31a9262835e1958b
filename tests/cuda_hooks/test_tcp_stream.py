"""The wire witness's stream decoder (cuda_hooks/tcp_stream.py: Streams), on byte streams
cut as the kernel's write calls cut them; no kernel or BPF needed. And the transfer name read
from a captured header (proto.transfer.transfer_of)."""

from __future__ import annotations

from kvguard.cuda_hooks.tcp_stream import Streams, WireReport
from kvguard.proto.transfer import transfer_of
from kvguard.testbed import wire


def message(obj: dict[str, object], payload: bytes) -> bytes:
    """What testbed.wire.send writes for one message (header and JSON, then the payload)."""
    body = wire.json.dumps(obj, separators=(",", ":")).encode()
    return wire.HEADER.pack(len(body), len(payload)) + body + payload


def feed(streams: Streams, data: bytes, cuts: list[int], head: int = 512) -> list[WireReport]:
    """Write `data` in pieces ending at `cuts`, capturing each write's first `head` bytes."""
    reports = []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        reports += streams.write(7, 3, end - start, data[start:end][:head])
    return reports


class TestDecoder:
    def test_a_transfer_split_over_many_writes_counts_each_payload_byte_once(self) -> None:
        data = message({"op": "kv", "req": "r1", "xfer": "p-x1", "bytes": 5000}, b"k" * 5000)
        streams = Streams()
        streams.open(7, 3)
        # the header split in two, the JSON in two, the payload in three
        assert feed(streams, data, [5, 20, 40, 1000, 3000]) == [WireReport(7, "p-x1", 5000, 3, True)]

    def test_messages_that_are_not_transfers_are_followed_but_not_reported(self) -> None:
        data = message({"op": "bootstrap", "req": "r1"}, b"") + message({"ok": True}, b"zz")
        data += message({"op": "kv", "req": "r2", "xfer": "p-x2"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, []) == [WireReport(7, "p-x2", 10, 1, True)]

    def test_a_transfer_cut_short_by_a_close_ends_with_what_was_written(self) -> None:
        data = message({"op": "kv", "req": "r1", "xfer": "p-x1"}, b"k" * 4096)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data[:1500], [700]) == []
        assert streams.close(7, 3) == [WireReport(7, "p-x1", 1500 - (len(data) - 4096), 2, True)]

    def test_a_header_beyond_the_captured_head_gives_the_connection_up(self) -> None:
        # Two messages in one write, the second's header past the first 64 bytes captured.
        first = message({"op": "noop", "pad": "x" * 80}, b"")
        data = first + message({"op": "kv", "req": "r1", "xfer": "p-x1"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, [], head=64) == [] and streams.lost == 1
        # ... until the descriptor is opened again (a new connection).
        streams.open(7, 3)
        assert feed(streams, message({"op": "kv", "xfer": "p-x2"}, b"k"), []) == [
            WireReport(7, "p-x2", 1, 1, True)
        ]

    def test_a_connection_opened_before_it_was_watched_is_not_guessed_at(self) -> None:
        streams = Streams()
        assert streams.write(7, 9, 100, b"k" * 100) == [] and streams.lost == 1

    def test_lost_events_give_every_open_connection_up(self) -> None:
        streams = Streams()
        streams.open(7, 3)
        streams.open(7, 4)
        streams.lose_all()
        assert streams.lost == 2
        assert feed(streams, message({"op": "kv", "xfer": "p-x1"}, b"k"), []) == []

    def test_a_message_whose_name_was_not_captured_is_counted_not_guessed(self) -> None:
        # A JSON of 600 bytes in one write, its xfer past the 64 bytes captured.
        data = message({"op": "kv", "pad": "x" * 500, "xfer": "p-x1"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, [], head=64) == [] and streams.unnamed == 1
        assert streams.lost == 0  # the stream is still followed: the next message is reported
        assert feed(streams, message({"op": "kv", "xfer": "p-x2"}, b"k"), []) == [
            WireReport(7, "p-x2", 1, 1, True)
        ]

    def test_the_transfer_is_named_by_the_captured_part_of_a_long_header(self) -> None:
        head = message({"op": "kv", "req": "r1", "xfer": "p-x9", "checksums": list(range(500))}, b"")[12:300]
        assert transfer_of(head) == "p-x9"
        assert transfer_of(b'{"op":"bootstrap","xfer":"p-x9"') == ""
        assert transfer_of(b'{"op":"kv","xfer":"p-x9","req":"r"}') == "p-x9"
