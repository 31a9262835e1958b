"""The vLLM adapter's block tables (agents/vllm/tables.py): one row a request, appended to,
rows reused, the batch's rows answered again only while nothing moved."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.agents.vllm.tables import Tables


def test_grants_append_to_each_requests_row_in_order() -> None:
    t = Tables(null=0, rows=2, width=2)
    t.put("a", 0, np.array([5, 6]))
    t.put("b", 0, np.array([7]))
    rows, at, parts = t.append([t.row_of["a"], t.row_of["b"]], [1, 3], [8, 9, 10, 11])
    assert rows.tolist() == [t.row_of["a"], t.row_of["b"]]
    assert at.tolist() == [2, 1] and parts.tolist() == [1, 3]
    assert t.table("a").tolist() == [5, 6, 8]  # the row widened past its first width
    assert t.table("b").tolist() == [7, 9, 10, 11]
    t.append([t.row_of["a"]], [1], [12])  # one block each: the decode path
    assert t.table("a").tolist() == [5, 6, 8, 12]


def test_rows_grow_and_are_reused_once_dropped() -> None:
    t = Tables(null=0, rows=1, width=4)
    for i in range(5):
        t.put(f"r{i}", 0, np.array([i + 1]))
    assert sorted(t.row_of.values()) == [0, 1, 2, 3, 4]
    row = t.row_of["r2"]
    t.drop("r2")
    assert "r2" not in t and t.table("r2").tolist() == []
    t.put("new", 0, np.array([9]))
    assert t.row_of["new"] == row and t.table("new").tolist() == [9]


def test_a_batch_s_rows_are_answered_again_only_while_no_row_moved() -> None:
    t = Tables(null=0, rows=4, width=4)
    for rid in ("a", "b", "c"):
        t.put(rid, 0, np.array([1]))
    batch = ["a", "b", "c"]
    first = t.rows(batch)
    assert t.rows(list(batch)) is first  # the same batch, the same rows: not looked up again
    # c is preempted and resumed in one step: a new row, and the same list of names.
    t.drop("c")
    t.put("x", 0, np.array([2]))  # takes c's old row
    t.put("c", 0, np.array([3]))
    again = t.rows(batch)
    assert again is not first and again[2] == t.row_of["c"] != first[2]


def test_a_request_kvguard_never_saw_is_named() -> None:
    t = Tables(null=0)
    with pytest.raises(KeyError, match="request ghost, whose blocks kvguard never saw granted"):
        t.rows(["ghost"])
