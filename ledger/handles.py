"""A node's request handles (`Handles`): the small numbers a node gives its requests at admit
(Admit.handle), which its steps then carry instead of names. Handles is the only writer of them.

Invariants, within the node's current epoch:
- a handle's low SLOT_BITS bits are its slot, the bits above how many times the slot was bound
  before; table[slot] is (the handle bound to it now, 0 if none; its request's index); a slot
  is bound by an admit and freed by its request's finish on the node, or when the ledger
  forgets the request;
- a handle names a request only while it is bound: any other (never given in this epoch,
  given in the epoch before, its request finished, its slot bound again since) is BadEvent
  "handle", worded with what is known of it, and judged against no request;
- a new epoch starts with no handle bound; the last epoch's are kept only to word that error.
"""

from __future__ import annotations

import numpy as np

from kvguard.ledger import _pages
from kvguard.ledger.findings import BadEvent

SLOT_BITS = 20
SLOTS = 1 << SLOT_BITS  # a node's requests with a handle at once, at most
SLOT_MASK = SLOTS - 1
HANDLE: np.dtype = _pages.HANDLE  # a slot (bound, req); its layout is ledger/pages.h's `Handle`
if _pages.HANDLE_SLOT_MASK != SLOT_MASK:
    raise ImportError(
        f"ledger/pages.h HANDLE_SLOT_MASK {_pages.HANDLE_SLOT_MASK:#x} is not handles.py's {SLOT_MASK:#x}"
    )


class Handles:
    """The handles of one node's current epoch (`table`, read by the C clean path), and what
    the slots held last (for the wording of a refusal)."""

    __slots__ = ("ended", "epoch", "names", "previous", "slot_of", "table")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.table = np.zeros(64, HANDLE)
        self.names: dict[int, str] = {}  # slot -> the name of the request bound (or last bound) there
        self.ended: dict[int, int] = {}  # slot -> the handle its last binding had, once it ended
        self.slot_of: dict[int, int] = {}  # request index -> its bound slot
        self.previous: dict[int, tuple[int, str]] = {}  # the epoch before's: handle -> (epoch, name)

    def __len__(self) -> int:
        """Handles bound now."""
        return len(self.slot_of)

    # ------------------------------------------------------------------ reading

    def lookup(self, handle: int, node: str) -> int:
        """The index of the request `handle` names now; BadEvent "handle" if it names none."""
        slot = handle & SLOT_MASK
        if 0 < slot < len(self.table) and handle == int(self.table["bound"][slot]):
            return int(self.table["req"][slot])
        raise BadEvent(self.why_not(handle, node), "handle")

    def why_not(self, handle: int, node: str) -> str:
        """Why `handle` names no request on `node` now, as much as is known of it."""
        slot = handle & SLOT_MASK
        head = f"handle {handle} on node {node} (epoch {self.epoch})"
        if not 0 < slot < len(self.table):
            if handle in self.previous:
                epoch, name = self.previous[handle]
                return f"{head} was given in epoch {epoch} (to {name}), not in this one: the engine restarted"
            if slot == 0:
                return f"{head} is not a handle: its slot is 0"
            return f"{head} was never given by an admit"
        bound = int(self.table["bound"][slot])
        name = self.names.get(slot, "")
        if bound:
            return f"{head} is stale: its slot was bound again since, to {name} (handle {bound})"
        if self.ended.get(slot) == handle:
            return f"{head} named {name}, which finished: a handle is not used after its request ends"
        if handle in self.previous:
            epoch, name = self.previous[handle]
            return f"{head} was given in epoch {epoch} (to {name}), not in this one: the engine restarted"
        return f"{head} was never given by an admit"

    def check_bind(self, handle: int, name: str, node: str) -> None:
        """BadEvent if an admit of request `name` may not bind `handle` (changes nothing)."""
        slot = handle & SLOT_MASK
        if slot == 0:
            raise BadEvent(
                f"admit of {name}: handle {handle} on node {node} is not a handle (slot 0)", "handle"
            )
        bound = int(self.table["bound"][slot]) if slot < len(self.table) else 0
        if bound and (bound != handle or self.names.get(slot) != name):
            raise BadEvent(
                f"admit of {name}: handle {handle} on node {node} (epoch {self.epoch}) is in use: its slot "
                f"names {self.names.get(slot, '?')} (handle {bound}) until that request finishes",
                "handle",
            )

    # ------------------------------------------------------------------ changes

    def bind(self, handle: int, req: int, name: str) -> None:
        """The admit of request `req` (`name`) binds `handle` (check_bind passed); a request
        holds one handle on a node: one bound before is freed."""
        slot = handle & SLOT_MASK
        old = self.slot_of.get(req)
        if old is not None and old != slot:
            self._free(old)
        if slot >= len(self.table):
            grown = np.zeros(max(slot + 1, 2 * len(self.table)), HANDLE)
            grown[: len(self.table)] = self.table
            self.table = grown
        self.table[slot] = (handle, req)
        self.names[slot] = name
        self.ended.pop(slot, None)
        self.slot_of[req] = slot

    def release(self, req: int) -> None:
        """Request `req` finished on this node: its handle (if it has one) names it no more."""
        slot = self.slot_of.get(req)
        if slot is not None:
            self._free(slot)

    def forget(self, reqs: set[int]) -> None:
        """The ledger forgot these requests (their indices will name others)."""
        for req in reqs & self.slot_of.keys():
            self._free(self.slot_of[req])

    def new_epoch(self, epoch: int) -> None:
        """The node's engine restarted: no handle is bound in `epoch`; this epoch's are kept to
        word a refusal of one used after the restart."""
        self.previous = {
            int(self.table["bound"][slot]): (self.epoch, self.names.get(slot, ""))
            for slot in self.slot_of.values()
        }
        self.epoch = epoch
        self.table = np.zeros(64, HANDLE)
        self.names, self.ended, self.slot_of = {}, {}, {}

    def _free(self, slot: int) -> None:
        row = self.table[slot]
        self.ended[slot] = int(row["bound"])
        del self.slot_of[int(row["req"])]
        self.table[slot] = (0, 0)

    # ------------------------------------------------------------------ snapshots

    def dump(self) -> list[list[object]]:
        """The bound handles, [slot, handle, request index, name] each, for a snapshot."""
        return [
            [slot, int(self.table["bound"][slot]), req, self.names.get(slot, "")]
            for req, slot in sorted(self.slot_of.items(), key=lambda item: item[1])
        ]

    def restore(self, epoch: int, rows: list[list[object]]) -> None:
        """The handles `dump` gave (of epoch `epoch`), the request indices as restored."""
        self.__init__(epoch)  # type: ignore[misc]
        for _slot, handle, req, name in rows:
            self.bind(int(handle), int(req), str(name))  # type: ignore[call-overload]
