"""Every fault switch of the testbed, end to end over HTTP: unguarded, its corruption shows in
the response content; guarded (enforce), it is caught with the right finding and no other
request is harmed. With every switch off, mixed multi-tenant traffic is served exactly and
kvguard finds nothing. Real processes, real TCP, real paged attention (echo model: a response
repeats its context, so whose data it holds is readable)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvguard.testbed.cluster import Cluster

SECRET = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private."  # 62 bytes, 4 pages
OTHER = "globex notes: quarterly review of supply contracts in Lyon."  # 59 bytes
PIN = "acme PIN 4417 ok"  # one page


Result = tuple[int, dict[str, Any]]


def text(result: Result) -> str:
    return Cluster.text(result[1])


def kinds(findings: list[dict[str, Any]]) -> set[str]:
    return {f["finding"] for f in findings}


def in_background(fn: Callable[[], Result]) -> tuple[threading.Thread, list[Result]]:
    out: list[Result] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def run(
    tmp_path: Path,
    guard: str,
    faults: tuple[str, ...],
    scenario: Callable[[Cluster], dict[str, Result]],
    **options: Any,
) -> tuple[dict[str, Result], list[dict[str, Any]]]:
    with Cluster(tmp_path / guard, faults=faults, guard=guard, **options) as cluster:
        results = scenario(cluster)
        findings = cluster.findings() if guard != "off" else []
    print(cluster.log[-4000:])  # the testbed's own account, shown when a test fails
    return results, findings


# ---------------------------------------------------------------------- scenarios


def incident(c: Cluster) -> dict[str, Result]:
    results = {"acme": c.complete("acme", SECRET, max_tokens=len(SECRET))}
    long_prompt = "Summarize: " + "the weather is mild and the markets are calm. " * 15
    results["globex"] = c.complete("globex", long_prompt, max_tokens=48)
    results["after"] = c.complete("acme", OTHER, max_tokens=len(OTHER))
    return results


def short_transfer(c: Cluster) -> dict[str, Result]:
    # One-page prompts travel whole; acme's answer fills decode pages 1-3 with its PIN.
    results = {"acme": c.complete("acme", PIN, max_tokens=48)}
    prompt = "globex asks: " + "x" * 50  # 63 bytes, 4 pages: 2 are sent
    results["globex"] = c.complete("globex", prompt, max_tokens=len(prompt))
    results["after"] = c.complete("initech", "one page prompt!", max_tokens=16)
    return results


def block_table(c: Cluster) -> dict[str, Result]:
    # acme decodes slowly; globex joins the batch while acme is running.
    thread, acme = in_background(lambda: c.complete("acme", SECRET, max_tokens=len(SECRET)))
    time.sleep(0.6)
    prompt = "globex asks: " + "y" * 49
    results = {"globex": c.complete("globex", prompt, max_tokens=len(prompt))}
    thread.join()
    results["acme"] = acme[0]
    return results


def double_free(c: Cluster) -> dict[str, Result]:
    # A prompt the prefill pool cannot hold is rejected; decode's abort path frees its 5
    # reserved pages, twice with the fault, so they are in the free list twice.
    results = {"rejected": c.complete("initech", "z" * 70, max_tokens=1)}
    # acme takes them (4 for its prompt, the 5th when its output crosses position 64) ...
    thread, acme = in_background(lambda: c.complete("acme", SECRET, max_tokens=24))
    time.sleep(1.2)
    # ... and globex, arriving meanwhile, takes the same pages again.
    results["globex"] = c.complete("globex", OTHER, max_tokens=len(OTHER))
    thread.join()
    results["acme"] = acme[0]
    return results


def late_write(c: Cluster) -> dict[str, Result]:
    # globex's long prompt prefills slowly; the router gives up and aborts it at decode.
    thread, slow = in_background(lambda: c.complete("globex", "G" * 40 + OTHER * 6, max_tokens=1))
    # Well after the abort (at prefill_timeout_s), well before globex's prefill ends (~2.4 s):
    # margins that hold on a loaded machine.
    time.sleep(1.0)
    # acme's request gets the pages released by the abort; its KV lands first ...
    results = {"acme": c.complete("acme", SECRET, max_tokens=len(SECRET))}
    thread.join()
    results["globex"] = slow[0]
    return results


def offload_free(c: Cluster) -> dict[str, Result]:
    results = {"acme": c.complete("acme", SECRET, max_tokens=len(SECRET))}
    # globex arrives while acme's prompt is still being offloaded to the host cache.
    prompt = "globex: the Lyon warehouse lease renews in March, budget 2M!"
    results["globex"] = c.complete("globex", prompt, max_tokens=len(prompt))
    time.sleep(0.8)
    # acme repeats its prompt: prefill restores it from the host cache.
    results["acme_again"] = c.complete("acme", SECRET, max_tokens=len(SECRET))
    return results


def cross_tenant_share(c: Cluster) -> dict[str, Result]:
    question = "What are today's specials?"
    results = {"acme": c.complete("acme", question, max_tokens=40)}
    results["globex"] = c.complete("globex", question, max_tokens=40)
    results["acme_again"] = c.complete("acme", question, max_tokens=40)
    return results


SYSTEM = {"acme": "[acme system: discount code ACME-7731] ", "globex": "[globex system: be brief] "}


# ---------------------------------------------------------------------- the switches


def test_incident(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "off", ("incident",), incident)
    status, reply = results["globex"]
    assert status == 200 and "deal closes Dec 14" in text(results["globex"])  # acme's memo, verbatim
    assert reply["usage"]["prompt_tokens"] > 600  # the client saw a normal, complete answer
    results, findings = run(tmp_path, "enforce", ("incident",), incident)
    assert results["globex"][0] == 500 and "Initech" not in str(results["globex"][1])
    assert "terminated by kvguard" in results["globex"][1]["error"]["message"]
    assert "config_drift" in kinds(findings)
    assert text(results["acme"]) == SECRET and text(results["after"]) == OTHER


def test_incident_caught_at_decode_when_prefill_is_unguarded(tmp_path: Path) -> None:
    """The decode node alone stops it too: its guard checks the hand-off against the bootstrap."""
    results, findings = run(tmp_path, "enforce", ("incident",), incident, unguarded_roles="prefill")
    assert results["globex"][0] == 500 and "Initech" not in str(results["globex"][1])
    assert {f["node"] for f in findings} == {"decode-0"}
    mismatch = [f for f in findings if f["finding"] == "transfer_mismatch"]
    assert mismatch and mismatch[0]["req"] == results["globex"][1]["error"]["message"].split()[1]


def test_short_transfer(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "off", ("short_transfer",), short_transfer)
    out = text(results["globex"])
    assert results["globex"][0] == 200 and out.startswith("globex asks: xxx")
    assert "PIN 4417" in out[32:]  # pages 3-4 were never sent: they still hold acme's answer
    results, findings = run(tmp_path, "enforce", ("short_transfer",), short_transfer)
    assert results["globex"][0] == 500 and "4417" not in str(results["globex"][1])
    mismatch = [f for f in findings if f["finding"] == "transfer_mismatch"]
    assert mismatch and {f["tenant"] for f in mismatch} == {"globex"}
    assert text(results["acme"]) == (PIN * 3)[:48] and text(results["after"]) == "one page prompt!"


def test_block_table(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "off", ("block_table",), block_table, decode_step_ms=40)
    out = text(results["globex"])
    assert out.startswith("globex asks: yyy") and "deal closes Dec 14" in out
    results, findings = run(tmp_path, "enforce", ("block_table",), block_table, decode_step_ms=40)
    assert results["globex"][0] == 500 and "Dec 14" not in str(results["globex"][1])
    foreign = [f for f in findings if f["finding"] == "foreign_read"]
    assert foreign and foreign[0]["victim_tenant"] == "acme"
    assert text(results["acme"]) == SECRET  # the victim, still running, is served exactly


def test_double_free(tmp_path: Path) -> None:
    options = {"prefill_pages": 4, "decode_step_ms": 100}
    results, _ = run(tmp_path, "off", ("double_free",), double_free, **options)
    assert results["rejected"][0] == 400
    acme_out = text(results["acme"])
    assert acme_out != SECRET[:24] and OTHER[18:23] in acme_out  # globex's KV in acme's pages
    results, findings = run(tmp_path, "enforce", ("double_free",), double_free, **options)
    assert results["rejected"][0] == 400
    assert "double_free" in kinds(findings)
    assert text(results["acme"]) == SECRET[:24] and text(results["globex"]) == OTHER


def test_late_write(tmp_path: Path) -> None:
    options = {"prefill_ms_per_token": 6, "prefill_timeout_s": 0.4, "decode_step_ms": 80}
    results, _ = run(tmp_path, "off", ("late_write",), late_write, **options)
    assert results["globex"][0] == 504
    assert text(results["acme"]) != SECRET and "GGGG" in text(results["acme"])  # globex's late KV
    results, findings = run(tmp_path, "enforce", ("late_write",), late_write, **options)
    assert results["globex"][0] == 504
    late = [f for f in findings if f["finding"] == "late_write"]
    assert late and late[0]["victim_tenant"] == "acme"
    assert text(results["acme"]) == SECRET


def test_offload_free(tmp_path: Path) -> None:
    options = {"offload_delay_ms": 400}
    results, _ = run(tmp_path, "off", ("offload_free",), offload_free, **options)
    again = text(results["acme_again"])
    assert again != SECRET and "Lyon warehouse" in again  # acme's restored prefix is globex's KV
    results, findings = run(tmp_path, "enforce", ("offload_free",), offload_free, **options)
    early = [f for f in findings if f["finding"] == "early_release"]
    assert early and early[0]["victim_tenant"] == "acme"
    assert text(results["acme_again"]) == SECRET and text(results["globex"]).startswith("globex: the Lyon")


def test_cross_tenant_share(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "off", ("cross_tenant_share",), cross_tenant_share, system_prompt=SYSTEM)
    assert "ACME-7731" in text(results["globex"])  # acme's hidden system prompt, served to globex
    results, findings = run(
        tmp_path, "enforce", ("cross_tenant_share",), cross_tenant_share, system_prompt=SYSTEM
    )
    share = [f for f in findings if f["finding"] == "cross_tenant_share"]
    assert share and share[0]["victim_tenant"] == "acme" and share[0]["tenant"] == "globex"
    assert text(results["globex"]).startswith(SYSTEM["globex"]) and "ACME" not in text(results["globex"])
    assert text(results["acme_again"]).startswith(SYSTEM["acme"])


@pytest.mark.parametrize("guard", ["monitor", "enforce"])
def test_all_switches_off_mixed_traffic(tmp_path: Path, guard: str) -> None:
    prompts = [
        ("acme", SECRET),
        ("globex", OTHER),
        ("initech", "x" * 16),  # exactly one page
        ("acme", "a short one"),
        ("globex", "multi-page prompt " * 9),
        ("umbrella", "ümlauts and emoji ☕ survive byte for byte"),
    ]
    options = {"prefix_cache": True, "host_cache": True, "system_prompt": SYSTEM, "offload_delay_ms": 20}

    def traffic(c: Cluster) -> dict[str, Result]:
        out: dict[str, Result] = {}
        threads = []
        for i, (tenant, prompt) in enumerate(prompts * 2):

            def go(i: int = i, tenant: str = tenant, prompt: str = prompt) -> None:
                out[f"{i}"] = c.complete(
                    tenant, prompt, max_tokens=len((SYSTEM.get(tenant, "") + prompt).encode())
                )

            threads.append(threading.Thread(target=go))
            threads[-1].start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        return out

    results, findings = run(tmp_path, guard, (), traffic, **options)
    for i, (tenant, prompt) in enumerate(prompts * 2):
        status, reply = results[f"{i}"]
        assert status == 200, reply
        assert text(results[f"{i}"]) == SYSTEM.get(tenant, "") + prompt
    assert findings == []


def half_written_page(c: Cluster) -> dict[str, Result]:
    # acme's two pages go back to the free list in order, so globex's long prompt gets them at
    # the same positions: what its chunked prefill leaves unwritten in its first page is acme's.
    results = {"acme": c.complete("acme", SECRET[:32], max_tokens=32)}
    prompt = "globex asks: " + "w" * 51  # 64 bytes, 4 full pages: prefilled in chunks
    results["globex"] = c.complete("globex", prompt, max_tokens=len(prompt))
    results["after"] = c.complete("initech", "one page prompt!", max_tokens=16)
    return results


def test_half_written_page(tmp_path: Path) -> None:
    results, _ = run(tmp_path, "off", ("half_written_page",), half_written_page)
    out = text(results["globex"])
    assert results["globex"][0] == 200 and out.startswith("globex a")
    assert out[8:16] == SECRET[8:16]  # slots 8-15 of its first page: acme's memo, verbatim
    results, findings = run(tmp_path, "enforce", ("half_written_page",), half_written_page)
    assert results["globex"][0] == 500 and SECRET[8:16] not in str(results["globex"][1])
    stale = [f for f in findings if f["finding"] == "stale_read"]
    assert stale and (stale[0]["tenant"], stale[0]["victim_tenant"]) == ("globex", "acme")
    assert text(results["acme"]) == SECRET[:32] and text(results["after"]) == "one page prompt!"


@pytest.mark.gpu
@pytest.mark.parametrize("guard", ["off", "enforce"])
def test_on_cuda_the_device_checks_stop_what_the_host_checks_stop(tmp_path: Path, guard: str) -> None:
    # The same leak with the pools and the echo model on the GPU: page checksums and the
    # decode step's tag check (the guard's kernels, cuda_hooks/kernels.py) run there.
    results, findings = run(tmp_path, guard, ("block_table",), block_table, decode_step_ms=40, device="cuda")
    if guard == "off":
        assert "deal closes Dec 14" in text(results["globex"])
        return
    assert results["globex"][0] == 500 and "Dec 14" not in str(results["globex"][1])
    foreign = [f for f in findings if f["finding"] == "foreign_read"]
    assert foreign and foreign[0]["victim_tenant"] == "acme"
    assert text(results["acme"]) == SECRET
