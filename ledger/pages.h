/* The ledger's page and request records, and the loops over an event's pages that both C
 * files of kvguard.ledger._pages use: _pages.c (the page API, pages.py its one caller) and
 * runs.c (runs of clean events applied whole). Header only for the loops (static inline).
 *
 * Invariant: every update is in two steps: a count of the pages that make the event more
 * than the clean case, which changes nothing, then the update itself, the same for a clean
 * event and for one the ledger has judged. Each update exists once, here.
 */
#ifndef KVGUARD_PAGES_H
#define KVGUARD_PAGES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL kvguard_ledger_pages_ARRAY_API
#ifndef KVG_PAGES_MAIN
#define NO_IMPORT_ARRAY /* only _pages.c imports NumPy's API; runs.c uses it */
#endif
#include <numpy/arrayobject.h>
#include <stddef.h>
#include <stdint.h>

#define NOBODY 0
#define HOLD_KINDS 5 /* pages.HOLDERS */

/* A page's state, one cache line: an event's pages are scattered over the pool, so a page
 * costs one miss however many of its fields the event touches. pages.py documents the
 * fields; `seen` is page_list's scratch (zero between calls), kept here so that checking a
 * page list also brings in the lines the update that follows will touch; `reserved` is 1 for
 * the ids the engine never hands out (PoolReport.reserved_pages: 0..reserved_pages-1), so
 * that a grant of one is never the clean case (grant_busy). */
typedef struct {
    int32_t owner, own;
    uint32_t use, gen;
    int32_t writer;
    uint32_t wgen, valid;
    int32_t prior;
    int64_t since;
    uint32_t holds[HOLD_KINDS];
    uint8_t seen, reserved;
    uint8_t pad[2];
} Page;

_Static_assert(sizeof(Page) == 64, "a page's record is one cache line");

/* A request's numbers (requests.py documents them): the clean path reads state and flags and
 * writes `last` and the counts of what it applied. */
typedef struct {
    int64_t last, queued;
    uint8_t state, flags;
    uint8_t pad[6];
    uint64_t prompt_tokens, output_tokens, bootstrap_tokens, reserved_pages, granted_pages, written_pages,
        freed_pages, shared_pages, sent_pages, sent_tokens, sent_bytes, received_pages, received_tokens,
        received_bytes, reads;
} Req;

/* A request handle's slot (handles.py documents them): the handle bound to it (0: none) and
 * its request's index. */
typedef struct {
    uint32_t bound;
    int32_t req;
} Handle;

#define HANDLE_SLOT_MASK ((1u << 20) - 1) /* handles.py: SLOT_BITS */

/* What apply_clean (runs.c) is handed about a run and hands back, in place: ledger.py's RUN. */
typedef struct {
    uint64_t last_seq, epoch;                   /* the node's: in and out; in */
    int64_t applied, next_sweep, grant_runs, wire; /* in and out; in; in; in */
    int64_t at, last_ts, transitions, missing, last_missing; /* out */
    int64_t kinds[5];                           /* out: alloc, write, free, read, step */
} RunCounts;

#define REQ_BYTES 256 /* proto/limits.py: a request id's bytes at most (requests.py checks they agree) */
#define ENDED 3   /* requests.STATES: rejected, aborted and killed come from here on */
#define RETIRED 1 /* requests' flags */
#define BOOTSTRAPPED 2
#define FINISHED 4 /* its engine said it finished (the C path neither reads nor writes it) */

extern PyArray_Descr *kvg_page_descr, *kvg_req_descr, *kvg_handle_descr, *kvg_run_descr; /* PAGE, REQ, HANDLE, RUN */

#define PREFETCH(addr) __builtin_prefetch((addr), 1)

/* Defined in _pages.c: the records of an array of `descr` (NULL with TypeError), and an
 * event's page list read from its bytes and checked. */
void *kvg_records(PyObject *o, PyArray_Descr *descr, npy_intp *n, const char *what, const char *type);
PyObject *kvg_decode_pages(const uint8_t *data, Py_ssize_t len, uint64_t field, npy_intp n, Page *state,
                           int distinct);
/* Defined in runs.c. */
PyObject *kvg_apply_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
/* Defined in tags.c. */
PyObject *kvg_check_tags(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvg_batch_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvg_batch_clean_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* The page updates, each in two steps: a count of the pages that make the event more than
 * the clean case, which changes nothing, then the update itself (the same for a clean event
 * and for one the ledger has judged). grant, land, end_grant and read_clean below, and
 * apply_clean, are built from these: each update exists once. */

/* Pages still in use (a live grant or a hold), or reserved (never to be handed out): handed
 * out early. */
static inline long
grant_busy(const Page *state, const npy_intp *pages, npy_intp count)
{
    long busy = 0;
    for (npy_intp i = 0; i < count; i++)
        busy += (state[pages[i]].use | state[pages[i]].reserved) != 0;
    return busy;
}

/* Every page granted to req: use = 1 + its holds (1 for a page not in use), gen + 1, owner
 * req, own NOBODY, prior = writer, since = ts when timed. */
static inline void
grant_pages(Page *state, const npy_intp *pages, npy_intp count, long req, int64_t ts, int timed)
{
    for (npy_intp i = 0; i < count; i++) {
        Page *page = &state[pages[i]];
        uint32_t users = 1;
        if (page->use != 0) /* only a page in use has holds */
            for (int k = 0; k < HOLD_KINDS; k++)
                users += page->holds[k];
        page->use = users;
        page->gen += 1;
        page->owner = (int32_t)req;
        page->own = NOBODY;
        page->prior = page->writer;
        if (timed)
            page->since = ts;
    }
}

/* Pages req does not own. */
static inline long
not_owned(const Page *state, const npy_intp *pages, npy_intp count, long req)
{
    long other = 0;
    for (npy_intp i = 0; i < count; i++)
        other += state[pages[i]].owner != req;
    return other;
}

/* Req's KV lands in every page: writer req, wgen = gen, valid = slots[i] (page_size when
 * slots is NULL), own req where req owns the page and NOBODY where it does not. */
static inline void
land_pages(Page *state, const npy_intp *pages, npy_intp count, long req, const uint32_t *slots, uint32_t page_size)
{
    for (npy_intp i = 0; i < count; i++) {
        Page *page = &state[pages[i]];
        page->writer = (int32_t)req;
        page->wgen = page->gen;
        page->valid = slots != NULL ? slots[i] : page_size;
        page->own = page->owner == req ? (int32_t)req : NOBODY;
    }
}

/* Req's grant of each page it owns ends: owner ~req, own NOBODY, use - 1, since = ts when
 * timed; the others are left as they are. */
static inline void
end_pages(Page *state, const npy_intp *pages, npy_intp count, long req, int64_t ts, int timed)
{
    for (npy_intp i = 0; i < count; i++) {
        Page *page = &state[pages[i]];
        if (page->owner != req)
            continue;
        page->owner = (int32_t)~req;
        page->own = NOBODY;
        page->use -= 1;
        if (timed)
            page->since = ts;
    }
}

/* Whether a context of `tokens` tokens through `pages` (exactly the pages it covers) reads
 * only req's own KV written under its current grant: every page's own tag is req and every
 * page is full, but the last, which holds at least the slots read of it. */
static inline int
read_is_clean(const Page *state, const npy_intp *pages, npy_intp count, long req, long long tokens,
              long long page_size)
{
    for (npy_intp i = 0; i < count; i++) {
        const Page *page = &state[pages[i]];
        if (page->own != req)
            return 0;
        if ((long long)page->valid < page_size &&
            (i != count - 1 || (long long)page->valid < tokens - (long long)(count - 1) * page_size))
            return 0;
    }
    return 1;
}

#endif
