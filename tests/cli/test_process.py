"""kvguard's services as child processes (the demo's, the tests'): configured by their own
arguments only, never by the host's kvguard configuration; one that does not start says why,
quiet or not."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.cli.process import start_daemon


def test_the_hosts_configuration_does_not_reach_a_child_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node's own settings (a file a daemon of its own would refuse here, and variables) must
    # not break the demo's daemon: it is configured by its arguments alone.
    node = tmp_path / "kvguard.yaml"
    node.write_text("daemon:\n  listen: 0.0.0.0:1\n  mdoe: enforce\n")
    monkeypatch.setenv("KVGUARD_CONFIG", str(node))
    monkeypatch.setenv("KVGUARD_DAEMON_MODE", "bogus")
    daemon = start_daemon(str(tmp_path / "audit.db"), quiet=True)
    try:
        assert daemon.address.startswith("127.0.0.1:") and not daemon.address.endswith(":1")
    finally:
        daemon.stop()


def test_a_quiet_child_that_does_not_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as caught:
        start_daemon(str(tmp_path / "audit.db"), 0, "--mode", "bogus", quiet=True)
    said = str(caught.value)
    assert said.startswith("kvguard daemon did not start: ") and "bogus" in said and "mode" in said
