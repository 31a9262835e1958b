"""The testbed's OpenAI-compatible API driven by the stock `openai` client: completions and chat,
whole and streamed, validation errors in OpenAI's shape, a request kvguard kills mid-stream,
and `kvguard testbed up` taking its workers down with it however it ends. Real processes,
real TCP, real paged attention (the echo model answers with its prompt)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvguard.testbed.cluster import Cluster

MODEL = "kvguard-echo"
SECRET = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Decode steps of 50 ms: a streamed answer comes in several chunks, token by token as made.
    with Cluster(tmp_path_factory.mktemp("openai"), guard="enforce", decode_step_ms=50) as c:
        yield c


def client(cluster: Cluster, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=tenant, max_retries=0, timeout=120)


def test_completions_whole_and_streamed(cluster: Cluster) -> None:
    api = client(cluster, "acme")
    assert [m.id for m in api.models.list().data] == [MODEL]
    prompt = "héllo, paged wörld"  # multi-byte characters: a token is a byte, a chunk whole characters
    size = len(prompt.encode())
    reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=size)
    assert reply.choices[0].text == prompt and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (size, size)
    chunks = list(
        api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=size, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == prompt and len([t for t in texts if t]) > 1  # in pieces, as decode made them
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == size


def test_chat_whole_and_streamed(cluster: Cluster) -> None:
    api = client(cluster, "globex")
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is paged attention?"}]},
    ]
    prompt = "You are terse.\nWhat is paged attention?"  # the contents, one a line
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=len(prompt))
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == prompt
    assert reply.usage.prompt_tokens == len(prompt)
    stream = api.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=len(prompt), stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "length" and {c.object for c in chunks} == {
        "chat.completion.chunk"
    }


def test_the_raw_stream_is_openai_server_sent_events(cluster: Cluster) -> None:
    api = client(cluster, "acme")
    with api.completions.with_streaming_response.create(
        model=MODEL, prompt="abc", max_tokens=3, stream=True
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_validation_errors_are_openai_errors(cluster: Cluster) -> None:
    api = client(cluster, "acme")
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert bad.value.body == {
        "message": "max_tokens: Input should be greater than or equal to 1",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError, match="prompt: must be a non-empty string"):
        api.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages: List should have at least 1 item"):
        api.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024") as long:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 1020}], stream=True
        )
    assert long.value.code == "context_length_exceeded"  # refused before a stream starts
    with pytest.raises(openai.NotFoundError, match="`gpt-9` does not exist"):
        api.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    # Without the client's own checks: a body with no prompt, one that is not JSON, no key.
    status, body = cluster.post("/v1/completions", {"model": MODEL, "max_tokens": 2}, tenant="acme")
    assert status == 400 and body["error"]["message"] == "prompt: Field required"
    with pytest.raises(openai.AuthenticationError, match="missing or malformed API key"):
        client(cluster, "not a tenant!").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert (
        cluster.post("/v1/embeddings", {}, tenant="acme")[1]["error"]["message"]
        == "no route POST /v1/embeddings"
    )
    errors = cluster.post("/admin/flush", {})[1]["errors"]  # counted, by code
    assert errors["context_length_exceeded"] >= 1 and errors["invalid_request_error"] >= 4


def test_a_stream_kvguard_kills_ends_with_its_error_not_another_tenants_text(tmp_path: Path) -> None:
    with Cluster(tmp_path, faults=("incident",), guard="enforce") as c:
        acme, globex = client(c, "acme"), client(c, "globex")
        assert (
            acme.completions.create(model=MODEL, prompt=SECRET, max_tokens=len(SECRET)).choices[0].text
            == SECRET
        )
        long_prompt = "Summarize: " + "the weather is mild and the markets are calm. " * 15
        received: list[str] = []
        with pytest.raises(openai.APIError, match="terminated by kvguard") as killed:
            for chunk in globex.completions.create(
                model=MODEL, prompt=long_prompt, max_tokens=48, stream=True
            ):
                received.append(chunk.choices[0].text)
        assert killed.value.body["type"] == "kvguard_terminated"
        assert "Initech" not in "".join(received) + str(killed.value.body)
        chat = globex.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=48, stream=True
        )
        with pytest.raises(openai.APIError, match="terminated by kvguard"):
            received = [chunk.choices[0].delta.content or "" for chunk in chat]
        # The non-streamed answer to the same request: HTTP 500 with the engine's message.
        with pytest.raises(openai.InternalServerError, match="terminated by kvguard"):
            globex.completions.create(model=MODEL, prompt=long_prompt, max_tokens=48)
        other = "globex notes: quarterly review of supply contracts in Lyon."
        after = globex.completions.create(model=MODEL, prompt=other, max_tokens=len(other), stream=True)
        assert "".join(chunk.choices[0].text for chunk in after) == other  # the next one is served
        assert "config_drift" in {f["finding"] for f in c.findings()}


def alive(pid: int) -> bool:
    """Whether pid is a running process (a zombie waiting for its reaper is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_the_workers_end_with_testbed_up(tmp_path: Path, stop: signal.Signals) -> None:
    with (tmp_path / "stderr").open("w") as stderr:  # shown if it fails
        up = subprocess.Popen(
            [sys.executable, "-m", "kvguard", "testbed", "up", "--port", "0", "--audit-dir", str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # only the router gets the signal, not its workers too
        )
    pids: list[int] = []
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        assert line.startswith("READY "), line
        pids += json.loads(line[6:])["pids"].values()
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        up.send_signal(stop)
        rc = up.wait(timeout=30)
        assert rc == (-signal.SIGKILL if stop == signal.SIGKILL else 0), (tmp_path / "stderr").read_text()
        deadline = time.monotonic() + 15  # SIGKILL: the kernel's SIGTERM (PR_SET_PDEATHSIG) ends them
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        for pid in pids:  # a test that failed leaves no worker behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait()
        if up.stdout is not None:
            up.stdout.close()


def test_the_operators_guide_curl_example_works_as_written(cluster: Cluster) -> None:
    # docs/operator.md's example, run with its port pointed at this cluster: the echo model
    # answers the prompt with the prompt.
    guide = (Path(__file__).parents[2] / "docs" / "operator.md").read_text()
    start = guide.index("curl -s localhost:8000/v1/completions")
    command = guide[start : guide.index("\n```", start)].replace("localhost:8000", cluster.url.split("//")[1])
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120)
    answer = json.loads(done.stdout)
    assert answer["model"] == MODEL and answer["choices"][0]["text"] == "hello there"
