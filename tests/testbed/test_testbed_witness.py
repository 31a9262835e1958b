"""The testbed with the CUDA shim preloaded into its workers (`--cuda-witness`; on this CPU
machine the decode step's kernels are launched on the stand-in CUDA driver): every attention
launch of a guarded run comes after a check, and with the `unguarded_attention` fault switch
(a decode path that skips the guard's check) the daemon reports it, naming the kernel, the
node and the step, while the responses stay exact: the witness is the only one to see it.
Real processes: testbed, node agent, daemon."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.testbed.cluster import Cluster

PROMPTS = [("acme", "acme memo: keep the Lyon figures private."), ("globex", "globex: weekly supply notes.")]


def serve(tmp_path: Path, faults: tuple[str, ...]) -> tuple[list[bool], list[pb.Finding], list[pb.Launches]]:
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    try:
        with Cluster(
            tmp_path / "c", guard="enforce", agent_socket=sock, cuda_witness=True, faults=faults
        ) as c:
            exact = []
            for tenant, prompt in PROMPTS:
                status, reply = c.complete(tenant, prompt, max_tokens=len(prompt))
                exact.append(status == 200 and Cluster.text(reply) == prompt)
        deadline = time.monotonic() + 20
        while True:  # until the agent has delivered the decode worker's last step
            s = Store(store)
            launches = [
                pb.Event.FromString(b).launches for _, _, b in s.rows(kind="event", node="decode-0/shim")
            ]
            findings = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            s.close()
            steps = sum(x.attention + x.unjudged for x in launches)
            if steps >= sum(len(p) for _, p in PROMPTS) or time.monotonic() > deadline:
                return exact, findings, launches
            time.sleep(0.2)
    finally:
        agent.stop()
        daemon.stop()


@pytest.mark.parametrize("fault", [False, True], ids=["checked", "unguarded_attention"])
def test_the_witness_sees_the_testbeds_attention(tmp_path: Path, fault: bool) -> None:
    exact, findings, launches = serve(tmp_path, ("unguarded_attention",) if fault else ())
    assert exact == [True, True]  # the fault harms no response: only the witness sees it
    # A decode step a token: the first one is the engine's warm-up (nothing ended or checked yet).
    judged = sum(x.attention for x in launches)
    assert judged + sum(x.unjudged for x in launches) >= sum(len(p) for _, p in PROMPTS)
    assert all(x.judged and not x.unnamed and not x.unwrapped for x in launches)
    assert sum(x.launches for x in launches) == 2 * (
        judged + sum(x.unjudged for x in launches)
    )  # norm + attention
    if not fault:
        assert sum(x.checked for x in launches) == judged and not any(x.unguarded for x in launches)
        assert not findings, [f.message for f in findings]
        return
    assert sum(x.unguarded for x in launches) == judged and judged > 0
    (found,) = findings  # every step unguarded, one finding: a path never checked is one fact
    assert (found.finding, found.rule, found.severity, found.node) == (
        "unguarded_attention",
        "unguarded_attention",
        "critical",
        "decode-0",
    )
    assert found.details["kernel"] == "kvguard_testbed_paged_attention" and found.details["graph"] == "0"
    assert int(found.details["step"]) >= 1
