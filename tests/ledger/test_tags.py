"""The check before attention (pages.check_tags, a C loop) against its definition written as
NumPy array operations, on random batches: int32 and int64 tables, the PAGE records' strided
columns and plain arrays, tables too short, pages out of range, no reader, empty contexts."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.ledger.findings import NOBODY
from kvguard.ledger.pages import PAGE, check_tags


def defined(
    own: np.ndarray, valid: np.ndarray, tables: np.ndarray, lens: np.ndarray, readers: np.ndarray, ps: int
) -> np.ndarray:
    tables, lens, readers = (np.asarray(a, dtype=np.int64) for a in (tables, lens, readers))
    cols = np.arange(tables.shape[1])
    need = np.clip(lens[:, None] - cols[None, :] * ps, 0, ps)  # slots read per page
    used = need > 0
    inside = (tables >= 0) & (tables < len(own))
    pages = np.where(used & inside, tables, 0)
    ok = ~used | (inside & (own[pages] == readers[:, None]) & (valid[pages] >= need))
    fits = lens <= tables.shape[1] * ps
    return (ok.all(axis=1) & fits & (readers != NOBODY)) | (lens == 0)


@pytest.mark.parametrize("seed", range(40))
def test_the_c_check_answers_as_its_definition(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ps, n, batch, width = (
        int(rng.choice([1, 4, 16])),
        int(rng.integers(1, 64)),
        int(rng.integers(0, 24)),
        int(rng.integers(0, 9)),
    )
    records = np.zeros(n, PAGE)
    records["own"] = rng.integers(0, 4, n)  # mostly the few readers below: many rows pass
    records["valid"] = rng.integers(0, ps + 1, n)
    tables = rng.integers(-1, n + 1, (batch, width)).astype(np.int32 if seed % 3 else np.int64)
    readers = rng.integers(0, 4, batch)
    for b in range(batch):  # a part of the rows point at pages their reader owns, fully written
        if rng.random() < 0.5 and width:
            mine = np.flatnonzero(records["own"] == readers[b])
            if len(mine):
                tables[b] = rng.choice(mine, width)
                records["valid"][mine] = ps
    lens = rng.integers(-2, width * ps + 3, batch) if batch else np.zeros(0, np.int64)
    lens[rng.random(batch) < 0.1] = 0
    # The records' own strided columns, as the ledger passes them, or plain arrays.
    own, valid = (
        (records["own"], records["valid"]) if seed % 2 else (records["own"].copy(), records["valid"].copy())
    )
    want = defined(own, valid, tables, lens, readers, ps)
    assert check_tags(own, valid, tables, lens, readers, ps).tolist() == want.tolist()
    assert (
        check_tags(own, valid, tables.T.copy().T, lens.astype(np.int32), readers, ps).tolist()
        == want.tolist()
    )


def test_bad_shapes_are_refused_with_what_is_wrong() -> None:
    own, valid = np.zeros(4, np.int32), np.zeros(4, np.uint32)
    with pytest.raises(ValueError, match="a batch of 2 tables, 1 lens"):
        check_tags(own, valid, np.zeros((2, 1), np.int64), np.zeros(1, np.int64), np.ones(2), 4)
    with pytest.raises(TypeError, match="tables must be a 2-d array"):
        check_tags(own, valid, np.zeros(2, np.int64), np.zeros(2, np.int64), np.ones(2), 4)
