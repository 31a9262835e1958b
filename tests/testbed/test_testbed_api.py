"""The testbed's HTTP API as clients see it: the stock OpenAI client unchanged, the status
codes of inference servers, and the guard's per-rule modes from the command line."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvguard.testbed.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    with Cluster(tmp_path_factory.mktemp("api"), guard="enforce") as c:
        yield c


def test_the_openai_client_works_unchanged(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="acme", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["kvguard-echo"]
    assert models.data[0].model_extra["max_model_len"] == 1024
    reply = client.completions.create(model="kvguard-echo", prompt="hello, paged world", max_tokens=18)
    assert reply.choices[0].text == "hello, paged world"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (18, 18)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.completions.create(model="kvguard-echo", prompt="x" * 1000, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)


def test_status_codes(cluster: Cluster) -> None:
    assert cluster.post("/v1/completions", {"prompt": "hi"})[0] == 401  # no API key
    assert cluster.post("/v1/completions", {"prompt": "hi"}, tenant="bad tenant!")[0] == 401
    status, body = cluster.post("/v1/completions", {"prompt": "", "max_tokens": 3}, tenant="acme")
    assert status == 400 and "prompt" in body["error"]["message"]
    status, body = cluster.post("/v1/completions", {"prompt": "hi", "max_tokens": 0}, tenant="acme")
    assert status == 400 and "max_tokens" in body["error"]["message"]
    assert cluster.post("/v1/nothing", {}, tenant="acme")[0] == 404
    # A long answer keeps repeating the context (the echo model reads position t at step t).
    status, body = cluster.post("/v1/completions", {"prompt": "abc", "max_tokens": 7}, tenant="acme")
    assert status == 200 and body["choices"][0]["text"] == "abcabca"


def test_a_rule_in_monitor_mode_lets_the_leak_through_and_reports_it(tmp_path: Path) -> None:
    secret = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private."
    with Cluster(
        tmp_path,
        faults=("incident",),
        guard="enforce",
        rule_mode={
            "config_drift_admission": "monitor",
            "rejected_progress": "monitor",
            "transfer_mismatch": "monitor",
        },
    ) as c:
        c.complete("acme", secret, max_tokens=len(secret))
        status, reply = c.complete(
            "globex", "Summarize: " + "calm markets, mild weather. " * 26, max_tokens=48
        )
        findings = c.findings()
    # Everything before attention was only reported; the check before attention still kills.
    assert status == 500 and "deal closes" not in str(reply)
    assert "stale_read_cross_tenant" in reply["error"]["message"]
    rules = {f["rule"] for f in findings}
    assert {
        "config_drift_admission",
        "rejected_progress",
        "transfer_mismatch",
        "stale_read_cross_tenant",
    } <= rules
