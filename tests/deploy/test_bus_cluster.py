"""The bus's JetStream cluster as docs/operator.md has an operator make it (`kvguard bus
config`, then `nats-server -c` each file): .ci/run starts one so (KVGUARD_TEST_NATS_DIR), and
elsewhere this test starts one the same way. It is three servers that place a stream's three
replicas one on each, and the agent's user it was given speaks only for its own node."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from bus_cluster import NatsCluster

from kvguard.cli.bus import DAEMON_USER
from kvguard.proto.bus import BusSettings, events_subject, stream_name


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    given = os.environ.get("KVGUARD_TEST_NATS_DIR")
    if given:
        yield Path(given)
        return
    if os.environ.get("CI"):
        pytest.fail("KVGUARD_TEST_NATS_DIR is not set: .ci/run starts the documented cluster")
    started = NatsCluster(tmp_path / "nats", "ci", {"ci-host": ["ci-node"]})
    yield started.dir
    started.stop()


def settings(directory: Path, user: str) -> BusSettings:
    servers = [json.loads((directory / f"server-{i}.conf").read_text())["listen"] for i in (1, 2, 3)]
    return BusSettings([f"nats://{s}" for s in servers], "ci", user, directory / "passwords" / user)


def test_the_documented_cluster_places_three_replicas_and_fences_its_agents(cluster_dir: Path) -> None:
    async def check() -> None:
        daemon = await settings(cluster_dir, DAEMON_USER).connect("kvguard-test")
        js = daemon.jetstream()
        for _ in range(100):  # the servers may still be electing their leader
            try:
                await js.account_info()
                break
            except Exception:
                await asyncio.sleep(0.2)
        name = stream_name("ci")
        await js.add_stream(name=name, subjects=["kvguard.v1.ci.>"], num_replicas=3, allow_direct=True)
        info = await js.stream_info(name)
        placed = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
        assert len(placed) == 3, f"the stream's replicas are on {placed}"
        errors: list[str] = []

        async def said(exc: Exception) -> None:
            errors.append(str(exc))

        agent = await settings(cluster_dir, "ci-host").connect("kvguard-test-agent", error_cb=said)
        ajs = agent.jetstream()
        ack = await ajs.publish(events_subject("ci", "c1", "ci-node"), b"", timeout=5)
        assert ack.stream == name
        with pytest.raises(Exception):  # noqa: B017 (a timeout: the server drops what it refuses)
            await ajs.publish(events_subject("ci", "c1", "other-node"), b"", timeout=2)
        assert any("permissions violation" in e.lower() for e in errors)
        await js.delete_stream(name)
        await agent.close()
        await daemon.close()

    asyncio.run(check())
