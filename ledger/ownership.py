"""Who owns, holds and reads each page (`Ownership`): the handlers of the page events (alloc,
write, free, hold, release, share, scrub, read) and their detectors: early release (a page
handed out while still in use, or a reserved one handed out at all), double free, late write,
use after free, stale and foreign reads, cross-tenant prefix sharing, and progress of a
request that must only drain.

Invariants: an event is validated whole before anything changes; the page state changes only
through PoolPages, a request's numbers only through Requests; a pool's `live` counts are the
pages each request is granted there now, and `grants` every page it ever was (what tells a
use after free from a foreign read). The clean common case of alloc, write, free and read is
also applied by the C clean path (runs.c, apply_clean), which must leave the same state.

Prefix caches as engines run them: a `share` is granted (one more user of each page, so it
stays out of the free pool; the sharer's reads of the origin's KV are clean) for a page still
granted to someone, and for a cache hit: a freed page whose content is still origin_req's
under the generation the page still has (writer == origin, wgen == gen: nobody was granted it
since the origin wrote it, and it was not scrubbed), as vLLM revives freed blocks from its free
queue and SGLang's radix tree keeps them (under a prefix_cache hold) until eviction. Any other
page given as a prefix is a use after free (a page handed out and rewritten since: the
eviction race). A tenant the policy keeps apart is a cross_tenant_share either way.

Reserved pages (PoolReport.reserved_pages: SGLang's padding page 0, vLLM's null block) are
never handed out by a sound engine, which keeps using them (CUDA graphs write the padded
entries' KV into page 0; block tables are padded with it). A grant of one is therefore an
early_release with no victim ("reserved"): reported, and the grant applied as the engine made
it, so that the request's own events on the page are judged as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvguard.ledger.access import Access, Shared
from kvguard.ledger.findings import NOBODY, BadEvent, Findings
from kvguard.ledger.pages import HOLDER_INDEX, HOLDERS, Verified, batch_clean, batch_clean_from, live_grants
from kvguard.ledger.pools import Node, Pool, Pools
from kvguard.ledger.requests import FIRST_ENDED, Request, Requests
from kvguard.ledger.transfers import Transfers
from kvguard.proto import pb


class Ownership:
    def __init__(
        self,
        pools: Pools,
        requests: Requests,
        transfers: Transfers,
        access: Access,
        findings: Findings,
    ) -> None:
        self.pools = pools
        self.requests = requests
        self.transfers = transfers
        self.access = access
        self.stats = access.stats
        self._found = findings

    def _since(self, pool: Pool) -> int | None:
        """The time a page change is stamped with: only pools registered for RDMA keep it."""
        return self._found.ts if pool.regions is not None else None

    # ------------------------------------------------------------------ grants

    def on_alloc(self, node: Node, a: pb.Alloc) -> None:
        pool = self.pools.pool(node, a.pool, "alloc")
        self.alloc(node, pool, pool.page_array(a, "alloc"), a.req)

    def alloc(self, node: Node, pool: Pool, pages: np.ndarray, req: str | Request) -> None:
        pp = pool.pages
        r = req if isinstance(req, Request) else self.requests.of_event(req, "alloc")
        if r.ended and not self.requests.drains(r, step=False):  # the forward under way at a kill: a drain
            self._found.progress(r, f"alloc of {len(pages)} page(s) on {node.name}")
        since = self._since(pool)
        if pp.grant(pages, r.idx, since):  # some still in use, or reserved: judged, then granted
            busy = pp.use[pages]
            if busy.any():
                self._early_release(r, pool, pages, busy)
            reserved = pages[pp.reserved[pages] != 0]
            if len(reserved):
                self._found.report(
                    "early_release",
                    f"{len(reserved)} reserved page(s) of pool {pool.pool} on {pool.node} were handed to "
                    f"{r.id}: the engine never hands them out and keeps using them (padding)",
                    req=r,
                    pool=pool.pool,
                    pages=reserved,
                    details={"users": "reserved"},
                    key=(pool.pool, "reserved"),
                )
            pp.grant(pages, r.idx, since, judged=True)
        if pool.granted(r.idx, pages):
            r.pools.append((node.name, pool.pool))
        self.requests.add(r, "granted_pages", len(pages))
        boot = r.bootstrap
        if boot is not None and boot[1] == node.name and not r.received_tokens:
            self.requests.add(r, "reserved_pages", len(pages))
        self.stats.page_transitions += len(pages)

    def _early_release(self, r: Request, pool: Pool, pages: np.ndarray, busy: np.ndarray) -> None:
        """Pages handed out while still in use: by a live grant (the previous grantee, or
        prefix sharers: of a freed page, a sharer is the victim) or by a holder (offload,
        transfer, abort path, prefix cache)."""
        pp = pool.pages
        sel = pages[busy > 0]
        refs, owner = pp.refs(sel), pp.owner[sel]
        kind = np.argmax(pp.holds[:, sel] > 0, axis=0)  # the first kind of hold still on each page
        holder = pp.holders(kind, sel)
        victims = np.where(refs > 0, np.where(owner >= 0, owner, ~owner), holder)
        freed = (refs > 0) & (owner < 0)  # only sharers still use it: a cache hit on a freed page
        if freed.any():
            sharer = self._sharers(pool, sel[freed])
            victims[freed] = np.where(sharer != NOBODY, sharer, victims[freed])
        for victim in np.unique(victims):
            mask = victims == victim
            held = pp.holds[:, sel[mask]].any(axis=1)
            users = (["live grant"] if (refs[mask] > 0).any() else []) + [
                f"{HOLDERS[k]} hold" for k in np.flatnonzero(held)
            ]
            self._found.report(
                "early_release",
                f"{int(mask.sum())} page(s) of pool {pool.pool} on {pool.node} were handed to {r.id} while "
                f"{self._found.name(int(victim)) or 'another user'} still used them ({', '.join(users)})",
                req=r,
                victim=int(victim),
                pool=pool.pool,
                pages=sel[mask],
                details={"users": ",".join(users)},
                key=(pool.pool, self._found.seq),
            )
        # Grants of the previous holders end here; their shares now point at foreign content.
        prev = pp.owner[sel]
        for victim in np.unique(prev[prev >= 0]).tolist():
            pool.ended(victim, int(np.count_nonzero(prev == victim)))

    def _sharers(self, pool: Pool, pages: np.ndarray) -> np.ndarray:
        """For each of `pages`, a request that shares it now as a prefix (NOBODY if none): a
        scan of the requests, for the rare finding that needs it."""
        found = np.full(len(pages), NOBODY, np.int32)
        key, gen = (pool.node, pool.pool), pool.pages.gen[pages]
        for r in self.requests.objects:
            if r is None:
                continue
            shared = r.shared.get(key)
            if shared is None or not len(shared.pages):
                continue
            current, _ = shared.lookup(pages, gen)
            found[current & (found == NOBODY)] = r.idx
            if (found != NOBODY).all():
                break
        return found

    # ------------------------------------------------------------------ content

    def on_write(self, node: Node, w: pb.Write) -> None:
        pool = self.pools.pool(node, w.pool, "write")
        pages = pool.page_array(w, "write")
        self.write(node, pool, pages, _slots(pool, w.slots, len(pages), "write"), w.req)

    def write(
        self,
        node: Node,
        pool: Pool,
        pages: np.ndarray,
        slots: np.ndarray | None,
        req: str | Request,
        payload: str = "write",
    ) -> None:
        r = req if isinstance(req, Request) else self.requests.of_event(req, payload)
        if r.ended and not self.requests.drains(r, step=payload == "step"):
            self._found.progress(r, f"{payload} of {len(pages)} page(s) on {node.name}")
        self.access.write(r, pool, pages, slots, drain=False)
        self.requests.add(r, "written_pages", len(pages))

    def on_step(self, node: Node, s: pb.Step) -> None:
        """A batch's forward step: its grants (one alloc per request granted pages, in order),
        then one write per request, in order; validated whole first."""
        pool = self.pools.pool(node, s.pool, "step")
        pages = pool.page_array(s, "step", distinct=False)  # distinct within each request's part
        counts = np.array(s.counts, np.int64)
        if s.reqs and s.handles:
            raise BadEvent("step: names its requests both by reqs and by handles (one of the two)")
        names: Sequence[str] = s.reqs
        if s.handles:  # every handle resolved before anything changes
            idx = [node.handles.lookup(h, node.name) for h in s.handles]
            names = [self.requests.name_of(i)[0] for i in idx]
        if len(counts) != len(names):
            raise BadEvent(f"step: {len(names)} requests with {len(counts)} counts (must match)")
        if int(counts.sum()) != len(pages):
            raise BadEvent(f"step: the counts add up to {int(counts.sum())}, pages lists {len(pages)}")
        grants = np.array(s.grants, np.int64)
        if len(grants) and (len(grants) != len(names) or (grants > counts).any()):
            raise BadEvent(
                f"step: {len(grants)} grants for {len(names)} requests, each at most its count of pages"
            )
        slots = _slots(pool, s.slots, len(pages), "step")
        bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
        parts = []
        for i, req in enumerate(names):
            part = pages[bounds[i] : bounds[i + 1]]
            if len(np.unique(part)) != len(part):
                raise BadEvent(f"step: {req} lists a page twice (pool {pool.pool} of node {node.name})")
            if not req:
                raise BadEvent("step: a request of the batch has no name")
            parts.append((req, part, None if slots is None else slots[bounds[i] : bounds[i + 1]]))
        for i in np.flatnonzero(grants).tolist():
            req, part, _ = parts[i]
            self.alloc(node, pool, part[len(part) - int(grants[i]) :], req)
        for req, part, part_slots in parts:
            self.write(node, pool, part, part_slots, req, "step")

    def on_scrub(self, node: Node, s: pb.Scrub) -> None:
        pool = self.pools.pool(node, s.pool, "scrub")
        pages = pool.page_array(s, "scrub")
        pool.pages.scrub(pages)
        self.stats.page_transitions += len(pages)

    # ------------------------------------------------------------------ frees and holds

    def on_free(self, node: Node, f: pb.Free) -> None:
        pool = self.pools.pool(node, f.pool, "free")
        self.free(node, pool, pool.page_array(f, "free"), f.req)

    def free(self, node: Node, pool: Pool, pages: np.ndarray, req: str) -> None:
        pp = pool.pages
        r = self.requests.of_event(req, "free")
        self.transfers.settle(r, "freed its pages")
        since = self._since(pool)
        n_mine = len(pages)
        if others := pp.end_grant(pages, r.idx, since):  # shares ending, or a double free
            n_mine -= others
            self._free_other(r, pool, pages[pp.owner[pages] != r.idx])
            pp.end_grant(pages, r.idx, since, judged=True)
        if n_mine:
            pool.ended(r.idx, n_mine)
        self.requests.add(r, "freed_pages", n_mine)
        self.stats.page_transitions += n_mine

    def _free_other(self, r: Request, pool: Pool, pages: np.ndarray) -> None:
        """Free of pages r does not own: the end of a prefix share, or a double free."""
        pp = pool.pages
        key = (pool.node, pool.pool)
        shared = r.shared.get(key)
        ended = np.zeros(len(pages), bool)
        if shared is not None and len(shared.pages):
            ended = np.isin(pages, shared.pages)
            current, _ = shared.lookup(pages, pp.gen[pages])
            done = pages[current]  # shares of pages re-granted since ended then (early_release)
            r.shared[key] = shared.without(pages[ended])
            pp.unshare(done)
            self.requests.add(r, "freed_pages", len(done))
        bad = pages[~ended]
        if len(bad):
            owner = pp.owner[bad]
            victims = np.where(owner >= 0, owner, NOBODY)
            name = self._found.name
            self._found.by_victim(
                "double_free",
                r,
                pool,
                bad,
                victims,
                lambda v: (
                    f"{r.id} freed page(s) it does not hold"
                    + (f": they are granted to {name(v)}" if v else ": they are already free")
                ),
            )
        self.stats.page_transitions += len(pages)

    def on_hold(self, node: Node, h: pb.Hold) -> None:
        pool = self.pools.pool(node, h.pool, "hold")
        pages = pool.page_array(h, "hold")
        k = HOLDER_INDEX.get(h.holder)
        if k is None:
            raise BadEvent(f"hold: holder {h.holder!r} is not one of {', '.join(HOLDERS)}")
        r = self.requests.of_event(h.req, "hold")
        pool.pages.hold(k, pages, r.idx, self._since(pool))
        self.stats.page_transitions += len(pages)

    def on_release(self, node: Node, h: pb.Release) -> None:
        pool = self.pools.pool(node, h.pool, "release")
        pages = pool.page_array(h, "release")
        k = HOLDER_INDEX.get(h.holder)
        if k is None:
            raise BadEvent(f"release: holder {h.holder!r} is not one of {', '.join(HOLDERS)}")
        held = pool.pages.holds[k, pages] > 0
        r = self.requests.of_event(h.req, "release")
        self.transfers.settle(r, f"released its {h.holder} hold")
        if not held.all():
            self._found.report(
                "double_free",
                f"{r.id} released a {h.holder} hold on {int((~held).sum())} page(s) of pool {pool.pool} on "
                f"{pool.node} that were not held",
                req=r,
                pool=pool.pool,
                pages=pages[~held],
                details={"holder": h.holder},
                key=(pool.pool, h.holder),
            )
            pages = pages[held]
        pool.pages.release(k, pages, r.idx, self._since(pool))
        self.stats.page_transitions += len(pages)

    # ------------------------------------------------------------------ prefix sharing

    def on_share(self, node: Node, s: pb.Share) -> None:
        pool = self.pools.pool(node, s.pool, "share")
        pages = pool.page_array(s, "share")
        r = self.requests.of_event(s.req, "share")
        origin = self.requests.of_event(s.origin_req, "share (origin_req)")
        if r.ended:
            self._found.progress(r, f"share of {len(pages)} prefix page(s) on {node.name}")
        pp = pool.pages
        state = pp.state[pages]
        writer = state["writer"]
        # Granted to someone still, or a cache hit: freed, its KV still the origin's under the
        # page's current generation (nobody was granted it since; a scrub clears the writer).
        given = (live_grants(state) > 0) | ((writer == origin.idx) & (state["wgen"] == state["gen"]))
        if not given.all():
            # Whose KV the sharer would read: the page's writer since (the eviction race), else the origin's.
            victims = np.where((writer != NOBODY) & (writer != origin.idx), writer, origin.idx)[~given]
            for victim in sorted(set(victims.tolist())):
                sel = pages[~given][victims == victim]
                self._found.report(
                    "use_after_free",
                    f"{r.id} was given {len(sel)} prefix page(s) of {origin.id} that are no longer "
                    f"granted to anyone and no longer hold its KV (pool {pool.pool} on {pool.node})"
                    + (f": they hold {self._found.name(victim)}'s" if victim != origin.idx else ""),
                    req=r,
                    victim=victim,
                    pool=pool.pool,
                    pages=sel,
                    key=(pool.pool, "share"),
                )
            pages = pages[given]
        if origin.tenant and r.tenant and origin.tenant != r.tenant:
            self._found.report(
                "cross_tenant_share",
                f"prefix cache shared {len(pages)} page(s) written by {origin.tenant} request {origin.id} "
                f"with {r.tenant} request {r.id}",
                req=r,
                victim=origin.idx,
                pool=pool.pool,
                pages=pages,
                key=(pool.pool,),
            )
        pp.share(pages)
        key = (node.name, s.pool)
        # What the sharer is promised: the origin's own KV, written under the page's current
        # grant. If the page holds anyone else's, the sharer's first read of it is a stale read.
        gen = pp.gen[pages]
        new = Shared(pages, gen, np.full(len(pages), origin.idx, np.int32), gen)
        old = r.shared.get(key)
        r.shared[key] = old.merged(new) if old is not None else new.merged(Shared(*(pages[:0],) * 4))
        self.requests.add(r, "shared_pages", len(pages))
        self.stats.page_transitions += len(pages)

    # ------------------------------------------------------------------ attention

    def on_read(self, node: Node, rd: pb.Read) -> None:
        self.pools.limits.check_read(node.name, len(rd.reads))
        checked = []
        for entry in rd.reads:  # validate the whole launch before reporting anything
            pool = self.pools.pool(node, entry.pool, "read")
            # A block table may name a page twice (engines pad with a null page): a read changes nothing.
            pages = self.access.pages_read(pool, pool.page_array(entry, "read", distinct=False), entry.tokens)
            checked.append((self.requests.of_event(entry.req, "read"), pool, pages, entry.tokens))
        self.read(node, checked)

    def read(self, node: Node, checked: list[tuple[Request, Pool, np.ndarray, int]]) -> None:
        """An attention launch whose every entry is valid: (reader, pool, pages it covers, tokens)."""
        for r, pool, pages, tokens in checked:
            self.transfers.settle(r, "read its pages")
            if r.ended and not self.requests.drains(r, step=False):
                self._found.progress(r, f"read (attention) on {node.name}")
            self.requests.add(r, "reads", 1)
            self.access.read(r, pool, pages, tokens)

    # ------------------------------------------------------------------ queries (the guard's)

    def batch_clean(
        self,
        node: str,
        pool: int,
        reqs: Sequence[str],
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        verified: Verified | None = None,
    ) -> np.ndarray:
        """The check before attention for a whole decode batch, as one set of array
        operations: True for each request whose every slot to be read holds its own KV,
        written under its current grant (and that may still make progress). Changes nothing
        and reports nothing: the guard sends the requests that fail it through a `read` event,
        which names the finding and the victim (prefix-shared pages also take that path,
        which accepts them). block_tables: [B, P] page ids (entries beyond a request's context
        are ignored); context_lens: [B] tokens each request attends to. With `verified`
        (batch_clean_from's arrays), each row only past what was verified
        before."""
        pp = self.pools.nodes[node].pools[pool].pages
        names = reqs if isinstance(reqs, list) else list(reqs)
        requests = self.requests
        if verified is None:
            return batch_clean(
                pp.state, block_tables, context_lens, names, requests.index, requests.table, pp.page_size
            )
        return batch_clean_from(
            pp.state,
            block_tables,
            context_lens,
            names,
            requests.index,
            requests.table,
            pp.page_size,
            *verified,
        )

    def clean_given_tags(
        self, readers: np.ndarray, tags_clean: np.ndarray, reads_nothing: np.ndarray
    ) -> np.ndarray:
        """batch_clean's answer from the tag check's (on the host or the GPU): a request that
        was rejected, aborted or killed may not attend, whatever its pages hold; one that
        reads nothing is clean."""
        ended = self.requests.states(readers) >= FIRST_ENDED
        clean: np.ndarray = (tags_clean & ~ended) | reads_nothing
        return clean

    def writable(self, node: str, pool: int, req: str, pages: Sequence[int]) -> bool:
        """Whether KV of `req` may land in `pages` now: each is granted to it, or kept for it by
        a transfer_recv hold after its grant ended (a transfer draining). A query only."""
        pp = self.pools.nodes[node].pools[pool].pages
        idx = np.asarray(pages, dtype=np.intp)
        if len(idx) and (idx.min() < 0 or idx.max() >= pp.num_pages):
            return False
        r = self.requests.index.get(req, NOBODY)
        owner = pp.owner[idx]
        return bool(r != NOBODY and ((owner == r) | pp.draining(r, idx, owner)).all())


def _slots(pool: Pool, values: Sequence[int], pages: int, payload: str) -> np.ndarray | None:
    """A write's (or a step's) valid slots, one a page and none beyond the page size; None when
    absent (full pages). BadEvent otherwise."""
    if not values:
        return None
    if len(values) != pages:
        raise BadEvent(f"{payload}: {len(values)} slots for {pages} pages (must match, or be empty)")
    slots = np.array(values, dtype=np.uint32)
    if int(slots.max()) > pool.pages.page_size:
        raise BadEvent(f"{payload}: {int(slots.max())} valid slots in a page of {pool.pages.page_size}")
    return slots
