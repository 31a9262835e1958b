"""kvguard on a real SGLang server, as it is served: SGLang 0.5.23's `sglang.launch_server
--device cpu` started through `kvguard run --mode enforce`, its events going to a real agent
and daemon, driven by the stock `openai` client. Its real Scheduler event loop runs the hooks
on real ScheduleBatches: the scheduler-start hook reports the pool, `run_batch` one step a
forward, the radix cache's hits are shares. The model is a tiny GPT-2 the tests make: SGLang's
rotary embedding on a CPU without AMX imports vLLM's compiled ops, which GPT-2's learned
positions do not need (docs/engines.md). Its words are noise; greedy decoding makes content
checkable: the same prompt gives the same tokens.

What a client must see: clean traffic answered and nothing found; a request an operator
stops through the daemon (`ControlService.Act`, the path every daemon kill takes, through the
agent and the guard into SGLang's own abort) ended for its client at once, in kvguard's words,
while the other requests go on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from audit_cli import events, query, receipt_of, sources, until
from engine_venvs import kinds, replay
from live_servers import Server, Services, free_port, sglang_serve, tiny_model

from kvguard.agents.receipt_header import HEADER as RECEIPT
from kvguard.proto.capture import event_to_json
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

NODE = "sg-c0"
PROMPT = "Tenant A asks about the quarterly report. " * 6


class Live(Services):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        port = free_port()
        self.server = self.serve(NODE, sglang_serve(tiny_model(root, "gpt2"), port), port)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    services = Live(tmp_path_factory.mktemp("sglang-serve"))
    try:
        services.server.wait_ready()
        yield services
    finally:
        services.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="sk-test", max_retries=0, timeout=60)


def complete(server: Server, prompt: str, salt: str, tokens: int = 8) -> dict[str, Any]:
    raw = client(server).completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )
    r = raw.parse()
    return {
        "id": r.id,
        "receipt": raw.headers.get(RECEIPT, ""),  # the request kvguard signs a receipt for
        "text": r.choices[0].text,
        "finish": r.choices[0].finish_reason,
        "usage": r.usage,
    }


def stop(live: Live, req: str) -> float:
    """An operator's kill of `req`, through the daemon; when it was ordered."""
    ordered = time.monotonic()
    with channel(live.daemon.address, None) as ch:
        svc_grpc.ControlServiceStub(ch).Act(
            svc.Action(kill=svc.KillRequest(req=req), reason="runaway request"),
            metadata=[("kvguard-user", "alice")],
            timeout=10,
        )
    return ordered


def test_clean_traffic_is_answered_and_nothing_is_found(live: Live) -> None:
    started = live.server.tail(100_000)
    assert f"kvguard: guarding sglang 0.5.23 as node {NODE} (enforce, colocated)" in started
    assert "tenants from cache_salt (a request without one has no tenant" in started
    first = complete(live.server, PROMPT, "tenant-a")
    again = complete(live.server, PROMPT, "tenant-a")  # a radix-cache hit, same tenant
    other = complete(live.server, PROMPT, "tenant-b")  # the same prompt, another tenant
    for r in (first, again, other):
        assert (r["finish"], r["usage"].completion_tokens) == ("length", 8), r
        assert r["usage"].prompt_tokens == first["usage"].prompt_tokens
    assert again["text"] == first["text"] == other["text"]
    chat = client(live.server).chat.completions
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    kw |= {"messages": [{"role": "user", "content": "Tenant B writes a poem about the sea."}]}
    kw |= {"extra_body": {"ignore_eos": True, "cache_salt": "tenant-c"}}
    whole = chat.create(**kw)
    with chat.with_streaming_response.create(stream=True, **kw) as response:
        streamed_receipt = response.headers.get(RECEIPT, "")  # sent with the stream's first part
        chunks = list(response.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens == 6
    # Each response names its request's receipt (SGLang's response id is the request's id);
    # each receipt is its tenant's and clean, its KV its own or its own tenant's prefix.
    assert [r["receipt"] for r in (first, again, other)] == [r["id"] for r in (first, again, other)]
    assert streamed_receipt == chunks[0].id
    tenants = ((first, "tenant-a"), (again, "tenant-a"), (other, "tenant-b"))
    shown = [receipt_of(live.store, live.receipt_pub, r["receipt"], t) for r, t in tenants]
    assert [(s["verdict"], set(sources(s))) for s in shown] == [
        ("clean", {"own"}),
        ("clean", {"own", "prefix_own_tenant"}),
        ("clean", {"own"}),
    ]
    assert receipt_of(live.store, live.receipt_pub, streamed_receipt, "tenant-c")["verdict"] == "clean"

    def ended(evs: list[Any]) -> int:
        return sum(1 for e in evs if e.node == NODE and e.HasField("finish"))

    evs = until(lambda: events(live.store), lambda evs: ended(evs) >= 5, timeout=30)
    mine = [e for e in evs if e.node == NODE]
    assert {e.admit.tenant for e in mine if e.HasField("admit")} >= {"tenant-a", "tenant-b", "tenant-c"}
    assert any(e.HasField("share") for e in mine)  # the hit was seen, and was clean
    assert sum(1 for e in mine if e.HasField("step")) >= 8 * 3  # one step a forward, from run_batch
    assert [r["finding"] for r in query(live.store, "--kind", "finding", "--node", NODE)] == []


def test_an_operators_kill_ends_the_request_for_its_client_at_once(live: Live) -> None:
    """A stream and a plain request, both long; the operator stops both through the daemon.
    Each client reads kvguard's words at once (the stream: an error event; the plain one:
    HTTP 403); a third request, running beside them, is answered in full."""
    stream = client(live.server).completions.create(
        model="tiny", prompt="Tenant B writes a poem about the sea.", max_tokens=900, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "cache_salt": "tenant-s"},
    )  # fmt: skip
    chunks = iter(stream)
    rid = next(chunks).id  # SGLang names the response by the request's id
    streamed: dict[str, Any] = {}

    def read_stream() -> None:
        """The stream read as it comes (a client that reads it: no backlog to drain after the
        kill), until its error event ends it; when that came."""
        try:
            for _ in chunks:
                pass
        except openai.APIError as exc:
            streamed.update(error=exc, at=time.monotonic())

    reader = threading.Thread(target=read_stream)
    reader.start()
    plain: dict[str, Any] = {}
    long_prompt = "Tenant A asks about the quarterly report, at length. " * 5

    def run_plain() -> None:
        try:
            r = client(live.server).completions.create(
                model="tiny", prompt=long_prompt, max_tokens=900, temperature=0,
                extra_body={"ignore_eos": True, "cache_salt": "tenant-p"},
            )  # fmt: skip
            plain["finish"] = r.choices[0].finish_reason
        except openai.APIStatusError as exc:
            plain.update(status=exc.status_code, message=exc.message, at=time.monotonic())
            plain["receipt"] = exc.response.headers.get(RECEIPT, "")

    thread = threading.Thread(target=run_plain)
    thread.start()
    # The bystander runs beside them: not waited for before the kills (a fast machine would
    # finish the stream's 900 tokens meanwhile, and a kill after the end is no kill).
    beside: dict[str, Any] = {}
    third = threading.Thread(
        target=lambda: beside.update(complete(live.server, PROMPT, "tenant-a", tokens=40))
    )
    third.start()
    admits = until(
        lambda: [e.admit for e in events(live.store) if e.HasField("admit") and e.admit.tenant == "tenant-p"],
        lambda found: len(found) == 1,
    )
    (plain_admit,) = admits
    ordered = stop(live, rid)
    reader.join(60)
    assert "error" in streamed, "the stream ended without kvguard's error event"
    stream_s = streamed["at"] - ordered
    ordered = stop(live, plain_admit.req)
    thread.join(60)
    assert stream_s < 2.0 and plain["at"] - ordered < 2.0
    for message in (str(streamed["error"].message), plain["message"]):
        assert (
            f"kvguard stopped request {rid if message is not plain['message'] else plain_admit.req}: "
            in message
        )
        assert "an operator stopped it on node sg-c0" in message
    assert plain["status"] == 403 and plain["receipt"] == plain_admit.req  # the error names it too
    third.join(60)
    assert beside["finish"] == "length" and beside["usage"].completion_tokens == 40
    kills = until(
        lambda: {(e.kill.req, e.kill.by) for e in events(live.store) if e.HasField("kill")},
        lambda found: len(found) >= 2,
    )
    assert kills >= {(rid, "unverified:alice"), (plain_admit.req, "unverified:alice")}
    # SGLang ran the forward it had formed when each kill reached it (its output dropped):
    # a drain, not progress; nothing is found.
    assert [r["finding"] for r in query(live.store, "--kind", "finding", "--node", NODE)] == []


def test_the_live_events_replay_to_the_same_verdicts(live: Live, tmp_path: Path) -> None:
    capture = tmp_path / "live.jsonl"
    capture.write_text("".join(event_to_json(e) + "\n" for e in events(live.store)))
    stored = {(r["finding"]["finding"], r["finding"]["req"]) for r in query(live.store, "--kind", "finding")}
    assert kinds(replay(capture)) == stored == set()
