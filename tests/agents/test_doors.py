"""The node agent's guard socket as an attacker on the same machine finds it (issue 26): a
second process saying hello as a node, a socket others could reach, a flood of connections
that never finish a frame, and whatever bytes a peer cares to send. Real processes on the
real socket, a real daemon behind the agent."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from agent_helpers import leak, stored, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from log_lines import said as said_lines

from kvguard.agents.agent import NodeAgent
from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.local import listening, recv_frame, send_frame
from kvguard.ruleset import load_ruleset

RULES = load_ruleset()


def counters(log: str) -> dict[str, int]:
    """The agent's last counters line (it says them at stop)."""
    (*_, line) = [line for line in log.splitlines() if "kvguard agent: counters:" in line]
    return {k: int(v) for k, v in (item.split("=") for item in line.split("counters: ")[1].split())}


# Another process of the same user, with the guard's own AgentSink: says hello as d0, reports
# what the agent answered, and at a line on stdin, which commands reached it.
IMPOSTOR = """
import sys, time
from kvguard.agents.guard import AgentSink
commands = []
sink = AgentSink(sys.argv[1], sys.argv[2], on_command=commands.append)
deadline = time.monotonic() + 10
while not sink.refused and not sink.ready.is_set() and time.monotonic() < deadline:
    time.sleep(0.02)
print("refused " + sink.refused if sink.refused else "welcomed", flush=True)
sys.stdin.readline()
print(f"commands {len(commands)}", flush=True)
"""


def test_a_second_process_cannot_take_over_a_node(tmp_path: Path) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    sock = tmp_path / "agent.sock"
    agent = start_agent(str(sock), daemon.address, str(tmp_path / "spool"))
    kills: list[str] = []
    sink = AgentSink(sock, "d0")
    impostor = None
    try:
        guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink, on_kill=lambda r, _: kills.append(r))
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        assert sink.wait_ready(20)
        impostor = subprocess.Popen(
            [sys.executable, "-c", IMPOSTOR, str(sock), "d0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert impostor.stdout is not None and impostor.stdin is not None
        # The newcomer is refused with a reason it can report, naming who holds the node.
        answer = impostor.stdout.readline()
        assert answer.startswith("refused node_taken: node d0 already has a guard connected")
        assert f"pid {os.getpid()} uid {os.getuid()} gid {os.getgid()} exe " in answer
        # The real guard keeps its node: its leak is judged, the kill comes back to it, and
        # every one of its events reaches the daemon (while the impostor keeps dialling).
        time.sleep(1.5)
        leak(guard)
        assert wait_for(lambda: kills == ["g1"])
        assert sink.flush()
        assert wait_for(lambda: len(stored(daemon.store)) == guard._seq)
        assert [e.seq for e in stored(daemon.store)] == list(range(1, guard._seq + 1))
        assert sink.refusals == 0
        impostor.stdin.write("\n")
        impostor.stdin.flush()
        assert impostor.stdout.readline() == "commands 0\n"  # no kill went astray
        impostor.wait(10)
        assert impostor.stderr is not None
        said = impostor.stderr.read()
        assert said.count("kvguard guard: the node agent refused node d0: node_taken:") == 1
    finally:
        if impostor is not None:
            impostor.kill()
            impostor.communicate()
        sink.close()
        log = agent.stop()
        daemon.stop()
    # Counted at every attempt, said once, with the newcomer's identity.
    refusals = [line for line in log.splitlines() if "refused a second guard for node d0" in line]
    assert len(refusals) == 1, log
    assert (
        f"pid {impostor.pid} uid {os.getuid()} gid {os.getgid()} exe {os.path.realpath(sys.executable)}"
        in (refusals[0])
    )
    assert counters(log)["duplicate_guards"] >= 2  # it dialled again after its 1 s back-off


def test_a_guard_whose_connection_has_gone_is_replaced_at_once(tmp_path: Path) -> None:
    # A guard that crashed (or reconnects) is not locked out by its own dead connection.
    agent = NodeAgent(tmp_path / "agent.sock", "127.0.0.1:1", tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    try:
        assert wait_for(lambda: (tmp_path / "agent.sock").exists())
        for _ in range(3):
            first = AgentSink(tmp_path / "agent.sock", "d0")
            assert first.wait_ready(20)
            first.close()
        assert agent.counters["duplicate_guards"] == 0
    finally:
        agent.stop()


def test_a_guard_that_goes_away_is_said_once(tmp_path: Path, capsys: object) -> None:
    # An engine whose adapter turned guarding off after its own failure closes its sink (as
    # one that exits does): the agent says the node is unguarded now, and counts it.
    agent = NodeAgent(tmp_path / "agent.sock", "127.0.0.1:1", tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    try:
        assert wait_for(lambda: (tmp_path / "agent.sock").exists())
        sink = AgentSink(tmp_path / "agent.sock", "gpu-2")
        assert sink.wait_ready(20)
        sink.close()
        assert wait_for(lambda: agent.counters["guards_gone"] == 1)
    finally:
        agent.stop()
    said = said_lines(capsys.readouterr().err)  # type: ignore[attr-defined]
    # (An earlier test's agent may still say its own guard went away while this one runs.)
    gone = [line for line in said if "went away" in line and "gpu-2" in line]
    assert gone == ["kvguard agent: the guard of gpu-2 went away; gpu-2 is unguarded until it reconnects"]


CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print(type(exc).__name__)
    sys.exit()
s.sendall(bytes.fromhex(sys.argv[2]))
s.recv(1)
print("connected")
"""


def _connects_as(uid: int, path: Path) -> str:
    """Whether a process of user `uid` can connect to the socket at `path` (a forked child)."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 3
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 1: "PermissionError"}.get(os.waitstatus_to_exitcode(status), "failed")


def test_the_socket_is_its_owners_only(tmp_path: Path) -> None:
    # In a directory anyone may pass through: only the socket's own mode keeps others out.
    room = Path(tempfile.mkdtemp(prefix="kvguard-door-"))
    room.chmod(0o755)
    agent = start_agent(str(room / "agent.sock"), "127.0.0.1:1", str(tmp_path / "spool"))
    try:
        assert (room / "agent.sock").stat().st_mode & 0o777 == 0o600
        # bound in a private directory, gone once the socket is in place: nothing left beside it
        assert sorted(p.name for p in room.iterdir()) == ["agent.sock", "agent.sock.shim"]
        if os.geteuid() == 0:  # another user is refused by the kernel, before the agent hears of it
            assert _connects_as(65534, room / "agent.sock") == "PermissionError"
            (room / "agent.sock").chmod(0o666)  # the check itself: wider, it would have connected
            assert _connects_as(65534, room / "agent.sock") == "connected"
    finally:
        agent.stop()
        shutil.rmtree(room)


def test_a_socket_path_that_fits_is_listened_on_however_long(tmp_path: Path) -> None:
    # A Unix socket's path holds at most 107 bytes. One of 100 (its shim's 105) fits, and so
    # must the path it is bound at first, in a private directory beside it.
    room = Path(tempfile.mkdtemp(prefix="kvguard-long-"))
    try:
        deep = room / ("d" * (100 - len(str(room)) - len("/agent.sock") - 1))
        deep.mkdir()
        path = deep / "agent.sock"
        assert len(str(path)) == 100
        server = listening(path)
        server.close()
        assert sorted(p.name for p in deep.iterdir()) == ["agent.sock"]
    finally:
        shutil.rmtree(room)


def test_a_change_of_the_guards_executable_is_reported(tmp_path: Path) -> None:
    # d0's guard runs in python; then a guard of d0 runs in another executable (a copy of it).
    other_exe = tmp_path / "not-the-engine"
    shutil.copy(os.path.realpath(sys.executable), other_exe)
    hello = svc.AgentMessage(hello=svc.Hello(node="d0", agent_version="guard")).SerializeToString()
    frame = (struct.pack(">I", len(hello)) + hello).hex()
    agent = start_agent(str(tmp_path / "agent.sock"), "127.0.0.1:1", str(tmp_path / "spool"))
    try:
        first = AgentSink(tmp_path / "agent.sock", "d0")
        assert first.wait_ready(20)
        first.close()
        second = subprocess.run(
            [str(other_exe), "-c", CONNECT, str(tmp_path / "agent.sock"), frame],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert second.stdout == "connected\n", second.stderr  # welcomed: d0 had no guard connected
    finally:
        log = agent.stop()
    (change,) = [line for line in log.splitlines() if "node d0's guard is now" in line]
    assert f"exe {other_exe}; it was pid {os.getpid()} " in change
    assert change.endswith(f"exe {os.path.realpath(sys.executable)}")
    assert counters(log)["guard_identity_changed"] == 1


def test_connections_are_bounded_and_unfinished_frames_time_out(tmp_path: Path) -> None:
    # 40 connections that begin a frame and never finish it (or never say anything): at most
    # 8 hold a thread, the rest are refused at the door, and those 8 are closed after the
    # frame timeout; a real guard refused meanwhile is served once there is room.
    daemon = start_daemon(str(tmp_path / "audit.db"))
    agent = NodeAgent(
        tmp_path / "agent.sock", daemon.address, tmp_path / "spool", max_guards=8, frame_timeout=1.0
    )
    agent.listen()
    threading.Thread(target=agent.serve, daemon=True).start()
    held: list[socket.socket] = []

    def guard_threads() -> int:
        return sum(t.name == "kvguard-guard" for t in threading.enumerate())

    try:
        threads = threading.active_count()
        hello = svc.AgentMessage(hello=svc.Hello(node="slow")).SerializeToString()
        for i in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(tmp_path / "agent.sock"))
            held.append(s)
            try:
                if i % 3 == 0:
                    s.sendall(b"\x00\x00")  # half a frame's length
                elif i % 3 == 1:
                    s.sendall(struct.pack(">I", 100) + b"x" * 10)  # a tenth of its body
            except (BrokenPipeError, ConnectionResetError):
                assert i >= 8  # only a connection refused at the door may be closed before it speaks
        assert wait_for(lambda: agent.counters["guards_over_limit"] == 32)
        assert guard_threads() == 8 and threading.active_count() == threads + 8
        refused = svc.DaemonMessage.FromString(recv_frame(held[-1]))
        assert (refused.error.code, refused.error.message) == (
            "busy",
            "the agent serves at most 8 guard connections",
        )
        sink = AgentSink(tmp_path / "agent.sock", "d0")  # refused while the door is full
        assert wait_for(lambda: sink.refused.startswith("busy: "))
        assert wait_for(lambda: agent.counters["frame_timeouts"] == 8)
        assert wait_for(lambda: guard_threads() <= 1)  # the real guard may be in already
        # A guard that said hello and then stalls mid-frame is closed too; the idle one is not.
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.connect(str(tmp_path / "agent.sock"))
        send_frame(slow, svc.AgentMessage(hello=svc.Hello(node="slow")))
        slow.sendall(struct.pack(">I", 50) + hello[:5])
        assert wait_for(lambda: agent.counters["frame_timeouts"] == 9)
        # ... and the real guard is served: its events reach the daemon.
        guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink)
        guard.pool(0, "decode", page_size=16, num_pages=8, context_len=128)
        assert sink.wait_ready(20)
        time.sleep(2.0)  # idle, well past the frame timeout: an idle guard is not a stalled one
        guard.heartbeat()
        assert sink.flush()
        assert wait_for(lambda: [e.seq for e in stored(daemon.store)] == [1, 2])
        assert agent.counters["frame_timeouts"] == 9
        sink.close()
        slow.close()
    finally:
        for s in held:
            s.close()
        agent.stop()
        daemon.stop()


# ---------------------------------------------------------------------------------- fuzzing


def _frame(message: bytes) -> bytes:
    return struct.pack(">I", len(message)) + message


def _events(first: int, n: int) -> tuple[bytes, list[tuple[int, int]]]:
    """A frame of d0's events numbered from `first`, and their positions."""
    events = [pb.Event(node="d0", seq=first + i, heartbeat=pb.Heartbeat()) for i in range(n)]
    return _frame(wire.frame([e.SerializeToString() for e in events])), [(0, e.seq) for e in events]


CHUNKS = st.lists(
    st.one_of(
        st.tuples(st.just("events"), st.integers(1, 5)),  # a whole frame of d0's events
        st.tuples(st.just("framed"), st.binary(max_size=64)),  # a frame of any bytes
        st.tuples(st.just("raw"), st.binary(max_size=64)),  # any bytes
        st.tuples(st.just("big"), st.integers(1 << 24, (1 << 32) - 1)),  # a length over the limit
        st.tuples(st.just("other"), st.integers(1, 3)),  # another node's events
    ),
    max_size=6,
)


def test_the_socket_framing_survives_any_bytes(tmp_path: Path) -> None:
    # Each case is one connection: a hello (or bytes that are none), then frames of d0's events
    # and whatever a peer may send (any bytes framed or not, lengths over the limit, another
    # node's events, an end mid-frame). The agent's connection thread always returns, raises
    # nothing, and spools every event of the whole frames that came before the first bad byte.
    agent = NodeAgent(tmp_path / "agent.sock", "127.0.0.1:1", tmp_path / "spool", frame_timeout=1.0)
    crashes: list[object] = []
    hook = threading.excepthook
    threading.excepthook = crashes.append
    seq = [0]

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(hello=st.one_of(st.none(), st.binary(max_size=24)), chunks=CHUNKS, cut=st.integers(0, 12))
    def case(hello: bytes | None, chunks: list[tuple[str, object]], cut: int) -> None:
        head = _frame(
            svc.AgentMessage(hello=svc.Hello(node="d0")).SerializeToString() if hello is None else hello
        )
        expected: list[tuple[int, int]] = []  # the events of the whole frames before any bad byte
        later: list[tuple[int, int]] = []  # those after: they may or may not be read
        tail = b""
        for kind, value in chunks:
            if kind == "events":
                frame, positions = _events(seq[0] + 1, value)  # type: ignore[arg-type]
                seq[0] += value  # type: ignore[operator]
                if tail or hello is not None:
                    later += positions
                    tail += frame
                else:
                    expected += positions
                    head += frame
            elif kind == "other":
                other = [pb.Event(node="d1", seq=i + 1, heartbeat=pb.Heartbeat()) for i in range(value)]  # type: ignore[call-overload]
                tail += _frame(wire.frame([e.SerializeToString() for e in other]))
            elif kind == "big":
                tail += struct.pack(">I", value)
            else:
                tail += value if kind == "raw" else _frame(value)  # type: ignore[operator, arg-type]
        stream = head + tail[: max(0, len(tail) - cut)]
        spool = agent._spool("d0")
        before = len(spool.pending)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        def write() -> None:
            with contextlib.suppress(OSError):  # the agent may hang up first
                ours.sendall(stream)
                ours.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=write)
        writer.start()
        assert agent.door.enter()
        agent._guard(theirs)  # what the agent runs for each connection: it must return
        writer.join()
        ours.close()
        got = list(spool.pending)[before:]
        assert got[: len(expected)] == expected  # nothing valid lost
        assert set(got[len(expected) :]) <= set(later)  # nothing made up
        assert not crashes
        spool.ack((1 << 64, 0))  # the next case starts from an empty spool

    try:
        case()
    finally:
        threading.excepthook = hook
        agent.stop()
