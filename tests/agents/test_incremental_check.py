"""The incremental check before attention (`stable`) gives the whole check's answer, step after
step, while requests come and go and pages are freed, granted again and written over behind a
reader's back; and it reads only what it has not verified before."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.agents.guard import Guard
from kvguard.ledger import _pages
from kvguard.ruleset import load_ruleset

PAGE = 4
RULES = load_ruleset()


class Batch:
    """A decode batch on one guard, its block tables kept as an engine keeps them (append only)."""

    def __init__(self, seed: int, pages: int = 400) -> None:
        self.rng = np.random.default_rng(seed)
        self.guard = Guard("n0", ruleset=RULES, mode="monitor", epoch=1)
        self.guard.pool(0, "colocated", page_size=PAGE, num_pages=pages, context_len=1 << 16)
        self.free = list(range(1, pages))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.checked: set[str] = set()  # requests the incremental check has seen, tables unchanged
        self.n = 0

    def admit(self) -> None:
        req = f"r{self.n}"
        self.n += 1
        tokens = int(self.rng.integers(1, 5 * PAGE))
        pages = [self.free.pop(0) for _ in range(-(-tokens // PAGE))]
        self.guard.admit(req, "t", tokens, "prefill")
        self.guard.alloc(req, 0, pages)
        slots = [PAGE] * (len(pages) - 1) + [tokens - (len(pages) - 1) * PAGE]
        self.guard.write(req, 0, pages, slots)
        self.tables[req], self.lens[req] = pages, tokens

    def finish(self, req: str) -> None:
        pages = self.tables.pop(req)
        del self.lens[req]
        self.checked.discard(req)
        self.guard.free(req, 0, pages[::-1])
        self.guard.finish(req, 1)
        self.free += pages

    def step(self) -> None:
        """Each request writes its next token (a new page when its last is full)."""
        reqs = list(self.tables)
        pages, slots, grants = [], [], []
        for req in reqs:
            table, n = self.tables[req], self.lens[req]
            fresh = n % PAGE == 0
            if fresh:
                table.append(self.free.pop(0))
            pages.append(table[n // PAGE])
            slots.append(n % PAGE + 1)
            grants.append(int(fresh))
            self.lens[req] = n + 1
        self.guard.step(0, reqs, np.array(pages), np.array(slots), grants=np.array(grants))

    def behind_a_readers_back(self) -> None:
        """A fault the engine could make: a page of a running request's verified prefix freed
        and granted to a new request that writes it (the reader still has it in its table)."""
        victim = str(self.rng.choice(list(self.tables)))
        table = self.tables[victim]
        if len(table) < 2:
            return
        page = table[int(self.rng.integers(0, len(table) - 1))]
        self.guard.free(victim, 0, [page])
        thief = f"x{self.n}"
        self.n += 1
        self.guard.admit(thief, "other", PAGE, "prefill")
        self.guard.alloc(thief, 0, [page])
        self.guard.write(thief, 0, [page], [PAGE])
        self.tables[thief], self.lens[thief] = [page], PAGE

    def compare(self) -> tuple[np.ndarray, int, int]:
        """Both checks of the batch as it stands: (the answer, entries read whole, incrementally)."""
        reqs = list(self.tables)
        width = max(len(t) for t in self.tables.values())
        tables = np.zeros((len(reqs), width), np.int64)
        for i, req in enumerate(reqs):
            tables[i, : len(self.tables[req])] = self.tables[req]
        lens = np.array([self.lens[r] for r in reqs], np.int64)
        stable = np.array([len(self.tables[r]) - 1 if r in self.checked else 0 for r in reqs], np.int64)
        ledger = self.guard.ledger
        whole = ledger.batch_clean("n0", 0, reqs, tables, lens)
        attention = self.guard.attention
        readers = ledger.reader_indices(reqs)
        verified = attention._verified.get(0)
        before = verified.upto[readers].copy() if verified is not None else np.zeros(len(reqs), np.int64)
        touched = len(verified.touched) if verified is not None else 0
        way = self.rng.integers(3)
        if way == 0:
            incremental = attention._clean_from(0, reqs, tables, lens, stable)
        else:  # the engine's whole array of tables, the batch's rows named (not gathered)
            rows = self.rng.permutation(len(reqs) + 3)[: len(reqs)].astype(np.int64)
            engine = np.full((len(reqs) + 3, width), -1, np.int64)
            engine[rows] = tables
            if way == 1:
                incremental = attention._clean_from(0, reqs, engine, lens, stable, rows)
            else:  # as SGLang's req_to_token: a token slot a column, each page named by its first
                slots = np.repeat(engine * PAGE, PAGE, axis=1) + np.tile(np.arange(PAGE), width)
                failing = attention.failing(0, reqs, slots, lens, stable, rows, in_slots=True)
                incremental = ~np.isin(np.array(reqs), [read["req"] for read in failing])
        self.checked.update(reqs)
        # What this check could skip: at most min(upto, stable) leading entries of each row.
        skipped = int(np.minimum(before, stable).sum()) if touched else 0
        assert np.array_equal(whole, incremental), (reqs, whole, incremental)
        entries = int((-(-lens // PAGE)).sum())
        return whole, entries, skipped


@pytest.mark.parametrize("seed", range(8))
def test_the_incremental_check_answers_as_the_whole_check(seed: int) -> None:
    batch = Batch(seed)
    for _ in range(6):
        batch.admit()
    caught = 0
    for step in range(120):
        batch.step()
        clean, _, _ = batch.compare()
        caught += int((~clean).sum())
        failing = [r for r, ok in zip(list(batch.tables), clean, strict=True) if not ok]
        roll = batch.rng.random()
        if roll < 0.1 and len(batch.tables) > 2:
            batch.finish(str(batch.rng.choice(list(batch.tables))))
        elif roll < 0.25:
            batch.admit()
        elif roll < 0.3:
            batch.behind_a_readers_back()
        if step % 10 == 9:  # rows the fault left failing go, as the engine would end them
            for req in failing:
                if req in batch.tables:
                    batch.finish(req)
    assert caught, "no fault was planted where a reader would read it: the test proves nothing"


def test_a_clean_decode_batch_reads_only_its_newest_pages() -> None:
    batch = Batch(0, pages=2000)
    for _ in range(32):
        batch.admit()
    for _ in range(40):
        batch.step()
        clean, entries, skipped = batch.compare()
        assert clean.all()
    # After the first checks, all but each row's last page (and a page newly full) are skipped.
    assert skipped >= entries - 2 * len(batch.tables), (entries, skipped)


def test_the_check_from_an_entry_names_its_arrays() -> None:
    guard = Guard("n0", ruleset=RULES, epoch=1)
    guard.pool(0, "colocated", page_size=PAGE, num_pages=8, context_len=64)
    pp = guard.ledger.nodes["n0"].pools[0].pages
    requests = guard.ledger.requests
    args = [
        pp.state,
        np.zeros((1, 2), np.int64),
        np.ones(1, np.int64),
        ["a"],
        requests.index,
        requests.table,
        PAGE,
    ]
    upto, by, none = np.zeros(len(requests.table), np.int64), np.zeros(8, np.int64), np.zeros(0, np.int64)
    with pytest.raises(ValueError, match="2 stable for 1 rows"):
        _pages.batch_clean_from(*args, np.zeros(2, np.int64), upto, by, none, None, 1)
    with pytest.raises(TypeError, match="upto must be a writable, contiguous 1-d array of int64"):
        _pages.batch_clean_from(*args, np.zeros(1, np.int64), upto[::2], by, none, None, 1)
    assert _pages.batch_clean_from(*args, np.zeros(1, np.int64), upto, by, none, None, 1).tolist() == [False]
    with pytest.raises(ValueError, match="row 5 of a batch is not one of the 1 tables"):
        _pages.batch_clean_from(*args, np.zeros(1, np.int64), upto, by, none, np.array([5]), 1)


def test_a_pool_made_anew_is_checked_whole_again() -> None:
    """The pool re-reported with another page size and as many pages: the ledger makes its
    records anew (nothing in them is anyone's), and what was verified before counts no more."""
    batch = Batch(1)
    for _ in range(3):
        batch.admit()
    for _ in range(3):
        batch.step()
        assert batch.compare()[0].all()
    batch.guard.pool(0, "colocated", page_size=2 * PAGE, num_pages=400, context_len=1 << 16)
    whole, _, _ = batch.compare()
    assert not whole.any()  # compare() asserted the incremental check says the same
