"""The daemon's door fuzzed, as Falco and Tetragon fuzz their parsers: hypothesis writes raw
AgentService stream messages (garbage bytes, a hello then batches of garbage or of real events
with bytes flipped, cut or repeated) to one real daemon process over real gRPC, on a fixed
budget. The daemon must answer every stream (an ack or a refusal with its reason), keep
serving, and never print a traceback."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from daemon_helpers import stale_reads
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.cli.process import Service, start_daemon
from kvguard.proto.kvguard.v1 import services_pb2 as svc

STREAM = "/kvguard.v1.AgentService/Stream"
REAL = [e.SerializeToString() for e in stale_reads("f0", 4)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    d = start_daemon(str(tmp_path_factory.mktemp("fuzz") / "audit.db"))
    yield d
    said = d.stop()
    assert "Traceback" not in said, said[-3000:]


@st.composite
def flipped(draw: st.DrawFn) -> bytes:
    """A real event's bytes, with some flipped, cut or doubled."""
    body = bytearray(draw(st.sampled_from(REAL)))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(body) - 1))
        body[i] = draw(st.integers(0, 255))
    how = draw(st.sampled_from(("as is", "cut", "doubled")))
    if how == "cut":
        body = body[: draw(st.integers(0, len(body)))]
    elif how == "doubled":
        body = body + body
    return bytes(body)


def hello(node: str) -> bytes:
    return svc.AgentMessage(hello=svc.Hello(node=node, agent_version="fuzz")).SerializeToString()


def batch(events: list[bytes]) -> bytes:
    return svc.RawAgentMessage(batch=svc.RawEventBatch(events=events)).SerializeToString()


messages = st.one_of(
    st.lists(st.binary(max_size=300), min_size=1, max_size=4),  # garbage from the first byte
    st.tuples(
        st.sampled_from(["f0", "f1", "f0/ebpf", "", "f0/../x", "\x00"]),
        st.lists(
            st.one_of(
                st.lists(flipped(), max_size=6).map(batch),
                st.lists(st.binary(max_size=200), max_size=4).map(batch),
                st.binary(max_size=200),
            ),
            max_size=4,
        ),
    ).map(lambda t: [hello(t[0]), *t[1]]),
)


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(messages)
def test_any_stream_gets_an_answer_and_the_daemon_serves_on(daemon: Service, stream: list[bytes]) -> None:
    with grpc.insecure_channel(daemon.address) as ch:
        call = ch.stream_stream(
            STREAM, request_serializer=None, response_deserializer=svc.DaemonMessage.FromString
        )
        answers = call(iter(stream), timeout=20)
        try:
            said = list(answers)  # acks, then the stream's end or a refusal with its reason
        except grpc.RpcError as exc:  # the transport's own refusal (a message it cannot read)
            assert exc.code() in (
                grpc.StatusCode.INTERNAL,
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.CANCELLED,
            ), exc
            said = []
        for answer in said:
            if answer.WhichOneof("body") == "error":
                assert answer.error.code and answer.error.message  # a refusal says why
        check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
