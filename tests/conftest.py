"""Shared fixtures: an audit store URL for each backend the daemon supports, and native
libraries for the CUDA probes' tests (a C compiler and the CUDA runtime library, no GPU).

`store_url` runs a test against SQLite (a file) and against a real PostgreSQL server (a
fresh database per test on the server named by KVGUARD_TEST_PG, which .ci/run installs and
starts). In CI a missing PostgreSQL server fails the tests instead of skipping them.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from kvguard.daemon.store import EventRun, Record, Store
from kvguard.daemon.writer import InlineWriter
from kvguard.proto.wire import Batch

PG = os.environ.get("KVGUARD_TEST_PG", "postgresql+psycopg://kvguard:kvguard@127.0.0.1:5432/kvguard_test")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what needs the machine's privileges or services (see pyproject's markers): the
    tests that load eBPF probes (they take `bpf_ready`) and the PostgreSQL runs of store
    tests."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "bpf_ready" in names:
            item.add_marker(pytest.mark.bpf)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("store_url") == "postgresql":
            item.add_marker(pytest.mark.postgres)
        if "pg_store_url" in names or "pg_databases" in names:
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(autouse=True)
def _stores_closed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every audit store a test opens is closed when it ends (its connections, its
    checkpoint thread), whether the test closed it or not: warnings are errors here, and a
    connection left to the garbage collector warns in whichever test runs then."""
    opened: list[Store] = []
    open_store = Store.__init__

    def init(self: Store, *args: object, **kwargs: object) -> None:
        open_store(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(Store, "__init__", init)
    yield
    for store in opened:
        store.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "audit.db")  # its head beside it
        return
    yield from _pg_database(tmp_path, monkeypatch)


@pytest.fixture
def pg_store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh PostgreSQL database (what several daemons on the bus share)."""
    yield from _pg_database(tmp_path, monkeypatch)


@pytest.fixture
def pg_databases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """`new()` -> a fresh PostgreSQL database's URL, as many as a test needs (dropped after it)."""
    made: list[Iterator[str]] = []

    def new() -> str:
        made.append(_pg_database(tmp_path, monkeypatch))
        return next(made[-1])

    yield new
    for database in made:
        for _ in database:  # its teardown
            pass


def _pg_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # The chain's head of a PostgreSQL store lies in the daemon's state directory (the
    # test's, for the daemons it starts too, and the Stores it opens).
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    admin = create_engine(PG, isolation_level="AUTOCOMMIT")
    name = f"kvguard_t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL server at {PG}: {exc}")
        pytest.skip(f"no PostgreSQL server at {PG} (set KVGUARD_TEST_PG): {exc.orig}")
    try:
        yield make_url(PG).set(database=name).render_as_string(hide_password=False)
    finally:
        # FORCE ends the sessions still in it; an autovacuum worker in it can be ended only by
        # a role with pg_signal_backend (.ci/run grants it), and is gone in a moment anyway.
        for attempt in range(20):
            try:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                break
            except DBAPIError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        admin.dispose()


# ---------------------------------------------------------------------------- native code

# An engine's CUDA code in miniature: a shared library linked against a CUDA runtime library
# (DT_NEEDED), whose copy() calls cudaMemcpy or cudaMemcpyAsync, loaded by Python with
# dlopen's RTLD_LOCAL (as torch's CUDA libraries are). The shim and the witness watch it.
COPIER = r"""
#include <stddef.h>
int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream);
static char buffer[1 << 16];
int copy(size_t n, int kind, int async_) {
    return async_ ? cudaMemcpyAsync(buffer, buffer + n, n, kind, 0) : cudaMemcpy(buffer, buffer + n, n, kind);
}
"""


def compile_library(out: Path, name: str, source: str, *links: tuple[Path, str]) -> Path:
    """A shared library `out/name` from C `source`, linked against each (folder, library)."""
    (out / f"{name}.c").write_text(source)
    args = [arg for folder, lib in links for arg in (f"-L{folder}", f"-l:{lib}", f"-Wl,-rpath,{folder}")]
    subprocess.run(["cc", "-shared", "-fPIC", "-o", out / name, out / f"{name}.c", *args], check=True)
    return out / name


@pytest.fixture(scope="session")
def compile_c() -> Callable[..., Path]:
    return compile_library


@pytest.fixture(scope="session")
def cuda_runtime() -> Path:
    """The folder of the real CUDA runtime library (nvidia-cuda-runtime-cu12; no GPU needed)."""
    import nvidia.cuda_runtime

    lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    assert (lib / "libcudart.so.12").exists(), f"no CUDA runtime library in {lib}"
    return lib


@pytest.fixture(scope="session")
def build_copier() -> Callable[[Path, Path], Path]:
    """(folder, the runtime's folder) -> the copier library built there against that runtime."""
    return lambda out, runtime: compile_library(out, "libcopier.so", COPIER, (runtime, "libcudart.so.12"))


class HeldWriter(InlineWriter):
    """The daemon's store writer with its commits held back until release(): a slow disk."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.held: list[tuple[Sequence[Batch], Sequence[Record | EventRun]]] | None = []
        self.committed: list[Sequence[Batch]] = []  # each group's batches, as committed

    def submit(self, batches: Sequence[Batch], parts: Sequence[Record | EventRun]) -> None:
        if self.held is None:
            self.committed.append(batches)
            super().submit(batches, parts)
        else:
            self.held.append((batches, parts))

    def release(self) -> None:
        """Commit what was held, and from now on each group as it comes (thread-safe)."""

        def go() -> None:
            held, self.held = self.held, None
            for batches, parts in held or []:
                self.committed.append(batches)
                super(HeldWriter, self).submit(batches, parts)

        assert self._loop is not None
        self._loop.call_soon_threadsafe(go)


@pytest.fixture
def held_writer() -> type[InlineWriter]:
    """HeldWriter (tests cannot import conftest): `held_writer(store)` makes one."""
    return HeldWriter
