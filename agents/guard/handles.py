"""The handles this guard gives its requests (`Handles`): a request's small number on this node
in this epoch (Admit.handle), which its steps carry instead of its name. Handles is the only
writer of them.

Invariants: a request holds one handle from its admit until its finish; a slot is given again
only after its request finished, with its round (the bits above the slot) one higher, so a
stale use of the old number is told apart by the ledger; a request without a handle (never
admitted here, or more than SLOTS at once) is named by its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvguard.ledger.handles import SLOT_BITS, SLOTS

ROUNDS = 1 << (32 - SLOT_BITS)  # a slot's rounds before its numbers come again


class Handles:
    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # request -> its handle
        self._free: list[int] = []  # slots whose request finished
        self._rounds = [0]  # slot -> how many times it was given before
        self._slots = 1  # slot 0 is none

    def give(self, req: str) -> int:
        """Request `req`'s handle, given now if it has none (0: none left: it is named by name)."""
        handle = self.of.get(req)
        if handle is not None:
            return handle
        if self._free:
            slot = self._free.pop()
        elif self._slots < SLOTS:
            slot = self._slots
            self._slots += 1
            self._rounds.append(0)
        else:
            return 0
        handle = self.of[req] = slot | (self._rounds[slot] % ROUNDS) << SLOT_BITS
        return handle

    def take_back(self, req: str) -> None:
        """Request `req` finished (or its admit was refused): its slot may be given again."""
        handle = self.of.pop(req, None)
        if handle is not None:
            slot = handle & (SLOTS - 1)
            self._rounds[slot] += 1
            self._free.append(slot)

    def of_batch(self, reqs: Sequence[str]) -> np.ndarray | None:
        """The handles of a batch's requests (int64), or None if one of them has none."""
        handles = np.fromiter(map(self.of.get, reqs, repeat(0)), np.int64, len(reqs))
        return handles if handles.all() else None
