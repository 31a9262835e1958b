"""How an engine adapter gets its guard inside the engine's own process (`Attachment`), from
the environment that `kvguard run` (or the operator's unit file) sets, and how the adapter's
own failures are contained.

Invariants:
- the settings are read once, each bad value named with its variable and the reason;
- an adapter hook that fails inside kvguard never raises into the engine: the failure is
  logged once, counted, and then either guarding stops and the engine goes on
  (`KVGUARD_ON_FAILURE=monitor`, the default) or the engine admits no new request
  (`stop`); the engine is only ever interrupted to stop the one request a verdict names;
- an engine version the adapter was not built against is refused at attach time, in one
  line, and the engine runs unguarded rather than guarded wrongly.

Environment: KVGUARD_NODE (the node's name; default the host name), KVGUARD_AGENT_SOCKET (the
node agent's socket) or KVGUARD_CAPTURE (a JSON Lines file), KVGUARD_MODE (enforce, monitor),
KVGUARD_ON_FAILURE (monitor, stop), KVGUARD_CLUSTER, KVGUARD_TENANT_FIELD (where the adapter
reads a request's tenant; adapters document their default).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvguard.agents.guard import AgentSink, CaptureSink, EventSink, Guard, GuardAPI, Mode, NullSink

log = logging.getLogger("kvguard.adapter")

OnFailure = Literal["monitor", "stop"]


class SettingsError(ValueError):
    """An environment variable kvguard reads holds a value it cannot use."""


@dataclass(frozen=True)
class Settings:
    node: str
    socket: str = ""
    capture: str = ""
    mode: Mode = "enforce"
    on_failure: OnFailure = "monitor"
    cluster: str = ""
    tenant_field: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        mode = env.get("KVGUARD_MODE", "enforce")
        if mode not in ("enforce", "monitor"):
            raise SettingsError(f"KVGUARD_MODE={mode!r}: must be enforce or monitor")
        on_failure = env.get("KVGUARD_ON_FAILURE", "monitor")
        if on_failure not in ("monitor", "stop"):
            raise SettingsError(f"KVGUARD_ON_FAILURE={on_failure!r}: must be monitor or stop")
        sock, capture = env.get("KVGUARD_AGENT_SOCKET", ""), env.get("KVGUARD_CAPTURE", "")
        if sock and capture:
            raise SettingsError("KVGUARD_AGENT_SOCKET and KVGUARD_CAPTURE are both set: choose one")
        node = env.get("KVGUARD_NODE", "") or socket.gethostname()
        return cls(
            node=node,
            socket=sock,
            capture=capture,
            mode=mode,  # type: ignore[arg-type]
            on_failure=on_failure,  # type: ignore[arg-type]
            cluster=env.get("KVGUARD_CLUSTER", ""),
            tenant_field=env.get("KVGUARD_TENANT_FIELD", ""),
        )

    def tenants(self) -> str:
        """Where tenants come from, in the words of an adapter's start-up line."""
        where = self.tenant_field if self.tenant_field not in ("", "cache_salt") else "cache_salt"
        return (
            f"tenants from {where} (a request without one has no tenant: cross-tenant sharing "
            "among such requests is not judged)"
        )

    def sink(self) -> EventSink:
        if self.socket:
            return AgentSink(self.socket, self.node)
        if self.capture:
            return CaptureSink(self.capture)
        return NullSink()


class VersionRefused(RuntimeError):
    """The engine's version is not one this adapter was built against."""


def check_version(engine: str, found: str, known: tuple[str, ...]) -> None:
    if found not in known:
        raise VersionRefused(
            f"kvguard: {engine} {found} is not a version this adapter knows ({', '.join(known)}); "
            f"not guarding it rather than guarding it wrongly"
        )


class EngineAttach:
    """How every adapter gets its guard in an engine process, one lifecycle for all: the
    engine's version checked against its ENGINES entry, the settings read (the environment,
    unless given), and the Attachment made, once, on first need (`attachment`). A refusal
    (a version the adapter does not know, a bad setting, no socket) is said in one line and
    kept (`refused`): the engine then runs unguarded, never guarded wrongly."""

    def __init__(
        self,
        engine: str,
        version: Callable[[], str],
        *,
        settings: Settings | None = None,
        attachment: Attachment | None = None,
        on_kill: Callable[[str, str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.version = version
        self.settings = settings if settings is not None else (attachment.settings if attachment else None)
        self.made = attachment
        self.refused = ""  # why this engine is not guarded ("" while it may be)
        self._on_kill = on_kill

    def version_known(self) -> bool:
        """Whether the running engine is a version its adapter knows (said once if not)."""
        if self.made is not None:
            return True
        if not self.refused:
            from kvguard.agents.engines import ENGINES

            try:
                check_version(self.engine, self.version(), ENGINES[self.engine].versions)
            except VersionRefused as exc:
                self._refuse(str(exc))
        return not self.refused

    def attachment(self) -> Attachment | None:
        """The guard, made on first need; None once refused."""
        if self.made is not None or not self.version_known():
            return self.made
        try:
            settings = self.settings if self.settings is not None else Settings.from_env()
            self.made = Attachment(self.engine, settings, on_kill=self._on_kill)
        except (SettingsError, OSError) as exc:
            self._refuse(f"kvguard: not guarding this {self.engine} process: {exc}")
            return None
        self.settings = settings
        return self.made

    def _refuse(self, why: str) -> None:
        self.refused = why
        log.error("%s", why)


class Attachment:
    """One engine process's guard and the adapter's failure state. Hooks run their kvguard
    work through `contain`; `stopped` tells the adapter's admission hook to refuse requests."""

    def __init__(
        self,
        engine: str,
        settings: Settings,
        *,
        guard: GuardAPI | None = None,
        on_kill: Callable[[str, str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.guard: GuardAPI = (
            guard
            if guard is not None
            else Guard(settings.node, mode=settings.mode, sink=settings.sink(), on_kill=on_kill)
        )
        self.failed = ""  # the first failure of the adapter itself, in words ("" while none)
        self.failures = 0
        self.refused = False  # `failed` says what the engine runs that the adapter does not map

    @property
    def active(self) -> bool:
        return not self.failed

    @property
    def stopped(self) -> bool:
        """The engine must admit nothing more: the adapter failed and the operator chose stop."""
        return bool(self.failed) and not self.refused and self.settings.on_failure == "stop"

    def contain(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run kvguard's part of a hook; a failure of kvguard itself is contained here (None)."""
        if self.failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # kvguard's own defect: never the engine's problem
            self.fail(f"{what}: {type(exc).__name__}: {exc}")
            return None

    def refuse(self, why: str) -> None:
        """A part of the engine the adapter does not map, found at start (a layout, a transfer
        backend): said in one line, and the engine goes on unguarded rather than guarded
        wrongly, whatever KVGUARD_ON_FAILURE says (this is no failure of kvguard's)."""
        if self.failed:
            return
        self.failed, self.refused = why, True
        log.error("%s", why)
        self.guard.sink.close()  # the agent learns it from the guard's connection ending

    def fail(self, why: str) -> None:
        self.failures += 1
        if self.failed:
            return
        self.failed = why
        then = (
            "the engine admits no new request (KVGUARD_ON_FAILURE=stop)"
            if self.settings.on_failure == "stop"
            else "guarding is off for this engine, which goes on (KVGUARD_ON_FAILURE=monitor)"
        )
        log.error("kvguard %s adapter failed in %s; %s", self.engine, why, then)
        # The agent learns it from the guard's connection ending.
        self.guard.sink.close()
