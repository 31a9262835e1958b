"""The block tables of one guarded vLLM pool as kvguard keeps them (`Tables`): one row a
request in one int64 array, appended to as blocks are granted, gathered for a whole batch at
once.

Invariant: a request's row holds, in vLLM's order, exactly the blocks kvguard has been told it
holds (its first `count` entries; what lies past them is stale and never read); rows of ended
requests are reused. Only `PoolState` writes it.
"""

from __future__ import annotations

import numpy as np

EMPTY = np.zeros(0, np.int64)


class Tables:
    def __init__(self, null: int, rows: int = 64, width: int = 64) -> None:
        self.null = null
        self.blocks = np.full((rows, width), null, np.int64)
        self.count = np.zeros(rows, np.int64)
        self.names = np.full(rows, "", dtype=object)  # the request a row is, for the guard's calls
        self.row_of: dict[str, int] = {}
        self._spare = list(range(rows - 1, -1, -1))
        self._version = 0  # + 1 whenever a request gets or loses a row
        self._asked: list[str] = []
        self._answer, self._answered_at = EMPTY, -1

    def __contains__(self, rid: str) -> bool:
        return rid in self.row_of

    def table(self, rid: str) -> np.ndarray:
        """The request's blocks (a view: copy what outlives the next change)."""
        row = self.row_of.get(rid)
        return EMPTY if row is None else self.blocks[row, : self.count[row]]

    def length(self, rid: str) -> int:
        row = self.row_of.get(rid)
        return 0 if row is None else int(self.count[row])

    def put(self, rid: str, at: int, blocks: np.ndarray) -> None:
        """The request's blocks from position `at` on are `blocks` (what was past them goes)."""
        row = self.row_of.get(rid)
        if row is None:
            row = self._row(rid)
        end = at + len(blocks)
        if end > self.blocks.shape[1]:
            self._widen(end)
        self.blocks[row, at:end] = blocks
        self.count[row] = end

    def append(
        self, rows: list[int], parts: list[int], blocks: list[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Grants to several requests at once: row rows[i] gets the next parts[i] of `blocks`.
        (rows, where each one's grants begin, parts) as arrays."""
        r, n = np.array(rows, np.int64), np.array(parts, np.int64)
        at = self.count[r]
        end = at + n
        if int(end.max()) > self.blocks.shape[1]:
            self._widen(int(end.max()))
        if len(blocks) == len(rows):  # one block each, as decode grants them
            self.blocks[r, at] = blocks
        else:
            rep = np.repeat(np.arange(len(r)), n)
            self.blocks[r[rep], at[rep] + np.arange(len(blocks)) - (np.cumsum(n) - n)[rep]] = blocks
        self.count[r] = end
        return r, at, n

    def rows(self, rids: list[str]) -> np.ndarray:
        """The rows of these requests (KeyError: one kvguard does not know); the last answer
        again while the list and every row are as they were."""
        if rids == self._asked and self._version == self._answered_at:
            return self._answer
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, rids), np.int64, len(rids))
        except KeyError as exc:
            raise KeyError(
                f"vLLM scheduled request {exc.args[0]}, whose blocks kvguard never saw granted "
                "(a path of vLLM's the adapter does not follow)"
            ) from None
        self._asked, self._answer, self._answered_at = list(rids), rows, self._version
        return rows

    def drop(self, rid: str) -> None:
        self._version += 1
        row = self.row_of.pop(rid, None)
        if row is not None:
            self.count[row] = 0
            self.names[row] = ""
            self._spare.append(row)

    def _row(self, rid: str) -> int:
        self._version += 1
        if not self._spare:
            n = len(self.count)
            self.blocks = np.concatenate((self.blocks, np.full_like(self.blocks, self.null)))
            self.count = np.concatenate((self.count, np.zeros(n, np.int64)))
            self.names = np.concatenate((self.names, np.full(n, "", dtype=object)))
            self._spare = list(range(2 * n - 1, n - 1, -1))
        row = self._spare.pop()
        self.row_of[rid] = row
        self.names[row] = rid
        return row

    def _widen(self, width: int) -> None:
        wider = np.full((len(self.count), max(width, 2 * self.blocks.shape[1])), self.null, np.int64)
        wider[:, : self.blocks.shape[1]] = self.blocks
        self.blocks = wider
