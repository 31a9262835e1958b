"""The engine registry (agents/engines.py) is the one place engines are named: pyproject's
entry points, `kvguard run`'s plugin lists, the agent's probes and the adapters' versions
all read it."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import pytest

from kvguard.agents import engine_watch
from kvguard.agents.attach import EngineAttach
from kvguard.agents.engines import ENGINES, engine
from kvguard.cli.run import PLUGIN_LISTS

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_each_engines_plugin_and_no_other() -> None:
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    declared = {group: dict(names) for group, names in points.items() if group != "console_scripts"}
    assert declared == {e.plugin_group: {"kvguard": e.plugin} for e in ENGINES.values()}
    for e in ENGINES.values():
        assert callable(pkgutil.resolve_name(e.plugin))  # importable without the engine


def test_kvguard_run_adds_itself_to_every_engines_allow_list() -> None:
    assert tuple(e.allow_list for e in ENGINES.values()) == PLUGIN_LISTS


def test_an_unknown_engine_is_refused_by_name_with_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"probe gpu-1: engine 'trtllm' is not one kvguard knows \(sglang, vllm\)"
    ):
        engine("trtllm", "probe gpu-1")
    with pytest.raises(ValueError, match="engine 'trtllm' is not one kvguard knows"):
        engine_watch.read_engine("trtllm", "/nonexistent.log")


def test_one_lifecycle_refuses_an_unknown_version_once_and_never_attaches() -> None:
    asked = []

    def version() -> str:
        asked.append(1)
        return "0.99.0"

    life = EngineAttach("vllm", version)
    assert life.attachment() is None and life.attachment() is None
    assert life.refused == (
        "kvguard: vllm 0.99.0 is not a version this adapter knows (0.32.0, 0.33.0); "
        "not guarding it rather than guarding it wrongly"
    )
    assert len(asked) == 1  # said once, kept


def test_bad_settings_are_a_refusal_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_MODE", "loud")
    life = EngineAttach("sglang", lambda: "0.5.23")
    assert life.version_known() and life.attachment() is None
    assert (
        life.refused
        == "kvguard: not guarding this sglang process: KVGUARD_MODE='loud': must be enforce or monitor"
    )
