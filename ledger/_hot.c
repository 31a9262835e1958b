/* The ledger's hot path in C: the events every request makes read from their bytes (creating
 * protobuf's objects for them costs more than applying them), an event's page list checked
 * and converted in one pass, and the page updates of those events (grant, write, free) and
 * the check before attention, each one loop over the event's pages instead of several NumPy
 * calls (each costs ~0.5 us of dispatch; a loop over 64 pages costs less than one of them).
 *
 * Invariants: every page is checked against the pool's bounds before anything changes.
 * An update first counts the pages that make the event more than the clean case (pages
 * still in use, not owned by the request); when there are some, it changes nothing unless
 * the caller says it has judged them (the ledger's findings come from Python, ledger.py,
 * reading the state as it was), then applies the one update, the same for clean and judged
 * events. Page lists must be distinct (page_list checks). A pool's state is one Page record
 * a page (PAGE, the NumPy dtype this module exports, is its layout; pages.PoolPages).
 * apply_clean applies whole runs of a node's events here, while each is the clean common
 * case, and stops before the first that is not (its judgment is ledger.py's): what it does
 * to the ledger's objects is what ledger.py's handlers do to them on that path, in the same
 * order, so that the state after either is the same to the byte (tests/test_property.py and
 * test_hot.py compare them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>
#include <stddef.h>
#include <stdint.h>

#define NOBODY 0
#define HOLD_KINDS 4 /* pages.HOLDERS */

/* A page's state, one cache line: an event's pages are scattered over the pool, so a page
 * costs one miss however many of its fields the event touches (as separate arrays, one miss
 * per array: 6-7 a page). pages.py documents the fields; `seen` is page_list's scratch
 * (zero between calls), kept here so that checking a page list also brings in the lines the
 * update that follows will touch. */
typedef struct {
    int32_t owner, own;
    uint32_t use, gen;
    int32_t writer;
    uint32_t wgen, valid;
    int32_t prior;
    int64_t since;
    uint32_t holds[HOLD_KINDS];
    uint8_t seen;
    uint8_t pad[7];
} Page;

_Static_assert(sizeof(Page) == 64, "a page's record is one cache line");

static PyArray_Descr *page_descr; /* PAGE: Page as a NumPy dtype, built from the struct */

#define PREFETCH(addr) __builtin_prefetch((addr), 1)

/* The records of a pool: a writable, C-contiguous, 1-d array of PAGE; else NULL with
 * TypeError. *n: its length. */
static Page *
pool_data(PyObject *o, npy_intp *n)
{
    if (!PyArray_Check(o) || !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)o), page_descr) ||
        PyArray_NDIM((PyArrayObject *)o) != 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        !PyArray_ISWRITEABLE((PyArrayObject *)o)) {
        PyErr_SetString(PyExc_TypeError, "state: a writable contiguous 1-d array of PAGE records expected");
        return NULL;
    }
    *n = PyArray_DIM((PyArrayObject *)o, 0);
    return PyArray_DATA((PyArrayObject *)o);
}

/* An intp page array, in range [0, n): its data and length, each page's record prefetched
 * (the misses overlap instead of being taken one after another: ~20 % less time an event);
 * else NULL with an exception. */
static const npy_intp *
page_data(PyObject *o, const Page *state, npy_intp n, npy_intp *count)
{
    if (!PyArray_Check(o) || !PyArray_EquivTypenums(PyArray_TYPE((PyArrayObject *)o), NPY_INTP) ||
        PyArray_NDIM((PyArrayObject *)o) != 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o)) {
        PyErr_SetString(PyExc_TypeError, "pages: a contiguous 1-d intp array expected");
        return NULL;
    }
    const npy_intp *pages = PyArray_DATA((PyArrayObject *)o);
    npy_intp len = PyArray_DIM((PyArrayObject *)o, 0);
    for (npy_intp i = 0; i < len; i++) {
        if (pages[i] < 0 || pages[i] >= n) {
            PyErr_Format(PyExc_IndexError, "page %zd out of range for %zd pages", (Py_ssize_t)pages[i],
                         (Py_ssize_t)n);
            return NULL;
        }
        PREFETCH(&state[pages[i]]);
    }
    *count = len;
    return pages;
}

/* The uint32 slots of a land: C-contiguous, 1-d, one a page; else NULL with TypeError. */
static const uint32_t *
slots_data(PyObject *o, npy_intp count)
{
    if (!PyArray_Check(o) || !PyArray_EquivTypenums(PyArray_TYPE((PyArrayObject *)o), NPY_UINT32) ||
        PyArray_NDIM((PyArrayObject *)o) != 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        PyArray_DIM((PyArrayObject *)o, 0) != count) {
        PyErr_Format(PyExc_TypeError, "slots: a contiguous 1-d uint32 array of %zd entries expected",
                     (Py_ssize_t)count);
        return NULL;
    }
    return PyArray_DATA((PyArrayObject *)o);
}

/* A `ts` argument: None (since is left as it is) or the time; -1 with an exception. */
static int
timestamp(PyObject *o, int64_t *ts)
{
    if (o == Py_None)
        return 0;
    *ts = PyLong_AsLongLong(o);
    return *ts == -1 && PyErr_Occurred() ? -1 : 1;
}

static int
check_args(Py_ssize_t nargs, Py_ssize_t want, const char *fn)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
        return -1;
    }
    return 0;
}

static PyObject *
raise_page(PyObject *type, long long page)
{
    PyObject *value = PyLong_FromLongLong(page);
    if (value != NULL) {
        PyErr_SetObject(type, value);
        Py_DECREF(value);
    }
    return NULL;
}

/* Reads a varint at *pos (< end); -1 if it runs past end or beyond 10 bytes. */
static int
varint(const uint8_t *data, Py_ssize_t end, Py_ssize_t *pos, uint64_t *value)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && *pos < end; shift += 7) {
        uint8_t b = data[(*pos)++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *value = v;
            return 0;
        }
    }
    return -1;
}

/* Skips the rest of group `number` (its start read): fields up to its end-group tag, groups
 * within it too (at most 64 deep); -1 if the bytes end first or another group ends. */
static int
skip_group(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos, uint64_t number, int depth)
{
    uint64_t key, value;
    if (depth >= 64)
        return -1;
    while (*pos < len) {
        if (varint(data, len, pos, &key) < 0)
            return -1;
        switch (key & 7) {
        case 0:
            if (varint(data, len, pos, &value) < 0)
                return -1;
            break;
        case 1:
            *pos += 8;
            break;
        case 2:
            if (varint(data, len, pos, &value) < 0 || value > (uint64_t)(len - *pos))
                return -1;
            *pos += (Py_ssize_t)value;
            break;
        case 3:
            if (skip_group(data, len, pos, key >> 3, depth + 1) < 0)
                return -1;
            break;
        case 4:
            return (key >> 3) == number ? 0 : -1;
        case 5:
            *pos += 4;
            break;
        default:
            return -1;
        }
        if (*pos > len)
            return -1;
    }
    return -1;
}

/* The values of varint field `field` (packed or not) in a serialized message: counted when
 * out is NULL, else stored in out. -1 with TypeError when the bytes are not a message. */
static Py_ssize_t
scan(const uint8_t *data, Py_ssize_t len, uint64_t field, npy_intp *out)
{
    Py_ssize_t pos = 0, got = 0;
    uint64_t key, value, size;
    while (pos < len) {
        if (varint(data, len, &pos, &key) < 0)
            goto bad;
        int wire = (int)(key & 7);
        if ((key >> 3) == field && wire == 0) {
            if (varint(data, len, &pos, &value) < 0)
                goto bad;
            if (out != NULL)
                out[got] = value > NPY_MAX_INTP ? NPY_MAX_INTP : (npy_intp)value;
            got++;
            continue;
        }
        switch (wire) {
        case 0:
            if (varint(data, len, &pos, &value) < 0)
                goto bad;
            break;
        case 1:
            pos += 8;
            break;
        case 2:
            if (varint(data, len, &pos, &size) < 0 || size > (uint64_t)(len - pos))
                goto bad;
            if ((key >> 3) == field) { /* packed */
                Py_ssize_t end = pos + (Py_ssize_t)size;
                while (pos < end) {
                    if (varint(data, end, &pos, &value) < 0)
                        goto bad;
                    if (out != NULL)
                        out[got] = value > NPY_MAX_INTP ? NPY_MAX_INTP : (npy_intp)value;
                    got++;
                }
            } else {
                pos += (Py_ssize_t)size;
            }
            break;
        case 3: /* a group: protobuf keeps one it does not know (any field number, ours too) */
            if (skip_group(data, len, &pos, key >> 3, 0) < 0)
                goto bad;
            break;
        case 5:
            pos += 4;
            break;
        default:
            goto bad;
        }
        if (pos > len)
            goto bad;
    }
    return got;
bad:
    PyErr_SetString(PyExc_TypeError, "page_list: the bytes are not a serialized protobuf message");
    return -1;
}

/* page_list(message, field, num_pages, state[, start, end]) -> intp array
 * The page list of an event's payload, read from the payload serialized (`field`: the
 * number of its `repeated uint32 pages`), or from bytes [start, end) of `message` (where
 * event_head found the payload): protobuf's own iteration makes a Python int of every page,
 * four times slower than decoding them here.
 * IndexError(page) for a page outside [0, num_pages); with `state` (the pool's records, of
 * num_pages; their `seen` bytes zero, and left zero), ValueError(page) for a page listed
 * twice. */
static PyObject *
decode_pages(const uint8_t *data, Py_ssize_t len, uint64_t field, npy_intp n, Page *state, int distinct);

static PyObject *
page_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6 && check_args(nargs, 4, "page_list") < 0)
        return NULL;
    if (!PyBytes_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "page_list: bytes expected, got %.80s", Py_TYPE(args[0])->tp_name);
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    uint64_t field = PyLong_AsUnsignedLongLong(args[1]);
    npy_intp n = PyLong_AsSsize_t(args[2]);
    if (nargs == 6) { /* the message is bytes [start, end) of args[0] */
        Py_ssize_t start = PyLong_AsSsize_t(args[4]), end = PyLong_AsSsize_t(args[5]);
        if (!PyErr_Occurred() && (start < 0 || end < start || end > len))
            PyErr_SetString(PyExc_ValueError, "page_list: [start, end) outside the bytes");
        data += start;
        len = end - start;
    }
    if (PyErr_Occurred())
        return NULL;
    Page *state = NULL;
    if (args[3] != Py_None) {
        npy_intp records;
        if (!(state = pool_data(args[3], &records)))
            return NULL;
        if (records != n)
            return PyErr_Format(PyExc_TypeError, "state: %zd records for a pool of %zd pages", (Py_ssize_t)records,
                                (Py_ssize_t)n);
    }
    return decode_pages(data, len, field, n, state, state != NULL);
}

/* page_list's work: the pages of varint field `field` in data[0, len) as a new intp array,
 * each in [0, n); with `state` (the pool's records, n of them) each page's record prefetched,
 * and with `distinct` also checked not to be listed twice (the `seen` bytes, zero before and
 * after). NULL with IndexError(page), ValueError(page) or TypeError (not a message). */
static PyObject *
decode_pages(const uint8_t *data, Py_ssize_t len, uint64_t field, npy_intp n, Page *state, int distinct)
{
    Py_ssize_t count = scan(data, len, field, NULL);
    if (count < 0)
        return NULL;
    npy_intp dims[1] = {count};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INTP);
    if (out == NULL)
        return NULL;
    npy_intp *pages = PyArray_DATA(out);
    scan(data, len, field, pages);
    if (state != NULL)
        for (Py_ssize_t j = 0; j < count; j++)
            if (pages[j] < n) /* not checked yet */
                PREFETCH(&state[pages[j]]);
    Py_ssize_t i = 0;
    for (; i < count; i++) {
        npy_intp page = pages[i];
        if (page >= n) {
            raise_page(PyExc_IndexError, page);
            break;
        }
        if (distinct) {
            if (state[page].seen) {
                raise_page(PyExc_ValueError, page);
                break;
            }
            state[page].seen = 1;
        }
    }
    if (distinct)
        for (Py_ssize_t j = 0; j < i; j++)
            state[pages[j]].seen = 0;
    if (i < count) {
        Py_DECREF(out);
        return NULL;
    }
    return (PyObject *)out;
}

/* The arguments of grant and end_grant: (pages, state, req, ts, judged), checked. */
typedef struct {
    Page *state;
    const npy_intp *pages;
    npy_intp count;
    long req;
    int64_t ts;
    int timed; /* ts is not None: since is set */
    int judged;
} Update;

static int
update_args(PyObject *const *args, Py_ssize_t nargs, const char *fn, Update *u)
{
    npy_intp n;
    if (check_args(nargs, 5, fn) < 0 || !(u->state = pool_data(args[1], &n)))
        return -1;
    u->req = PyLong_AsLong(args[2]);
    u->ts = 0;
    u->timed = timestamp(args[3], &u->ts);
    u->judged = PyObject_IsTrue(args[4]);
    if (PyErr_Occurred())
        return -1;
    u->pages = page_data(args[0], u->state, n, &u->count);
    return u->pages == NULL ? -1 : 0;
}

/* The page updates, each in two steps: a count of the pages that make the event more than
 * the clean case, which changes nothing, then the update itself (the same for a clean event
 * and for one the ledger has judged). grant, land, end_grant and read_clean below, and
 * apply_clean, are built from these: each update exists once. */

/* Pages still in use (a live grant or a hold): handed out early. */
static long
grant_busy(const Page *state, const npy_intp *pages, npy_intp count)
{
    long busy = 0;
    for (npy_intp i = 0; i < count; i++)
        busy += state[pages[i]].use != 0;
    return busy;
}

/* Every page granted to req: use = 1 + its holds (1 for a page not in use), gen + 1, owner
 * req, own NOBODY, prior = writer, since = ts when timed. */
static void
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
static long
not_owned(const Page *state, const npy_intp *pages, npy_intp count, long req)
{
    long other = 0;
    for (npy_intp i = 0; i < count; i++)
        other += state[pages[i]].owner != req;
    return other;
}

/* Req's KV lands in every page: writer req, wgen = gen, valid = slots[i] (page_size when
 * slots is NULL), own req where req owns the page and NOBODY where it does not. */
static void
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
static void
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
static int
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

/* grant(pages, state, req, ts, judged) -> busy
 * Counts the pages still in use. If none, or once the ledger has judged them (judged true),
 * grants every page to req (grant_pages; since = ts unless ts is None). Else changes
 * nothing. Returns the count. */
static PyObject *
grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Update u;
    if (update_args(args, nargs, "grant", &u) < 0)
        return NULL;
    long busy = grant_busy(u.state, u.pages, u.count);
    if (!busy || u.judged)
        grant_pages(u.state, u.pages, u.count, u.req, u.ts, u.timed);
    return PyLong_FromLong(busy);
}

/* land(pages, state, req, slots, page_size, judged) -> foreign
 * Counts the pages req does not own. If none, or once the ledger has judged them, req's KV
 * lands in every page (land_pages; full pages when slots is None). Else changes nothing.
 * Returns the count. */
static PyObject *
land(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 6, "land") < 0)
        return NULL;
    npy_intp n, count;
    Page *state = pool_data(args[1], &n);
    if (state == NULL)
        return NULL;
    long req = PyLong_AsLong(args[2]);
    unsigned long page_size = PyLong_AsUnsignedLong(args[4]);
    int judged = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred())
        return NULL;
    const npy_intp *pages = page_data(args[0], state, n, &count);
    if (pages == NULL)
        return NULL;
    const uint32_t *slots = NULL;
    if (args[3] != Py_None && !(slots = slots_data(args[3], count)))
        return NULL;
    long foreign = not_owned(state, pages, count, req);
    if (!foreign || judged)
        land_pages(state, pages, count, req, slots, (uint32_t)page_size);
    return PyLong_FromLong(foreign);
}

/* end_grant(pages, state, req, ts, judged) -> not_owned
 * Counts the pages req does not own. If none, or once the ledger has judged them, req's
 * grant of each page it owns ends (end_pages; since = ts unless ts is None). Else changes
 * nothing. Returns the count. */
static PyObject *
end_grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Update u;
    if (update_args(args, nargs, "end_grant", &u) < 0)
        return NULL;
    long other = not_owned(u.state, u.pages, u.count, u.req);
    if (!other || u.judged)
        end_pages(u.state, u.pages, u.count, u.req, u.ts, u.timed);
    return PyLong_FromLong(other);
}

/* The arguments of read_clean and read_victims: (pages, state, req, tokens, page_size), checked. */
typedef struct {
    const Page *state;
    const npy_intp *pages;
    npy_intp count;
    long req;
    long long tokens, page_size;
} Read;

static int
read_args(PyObject *const *args, Py_ssize_t nargs, const char *fn, Read *r)
{
    npy_intp n;
    if (check_args(nargs, 5, fn) < 0 || !(r->state = pool_data(args[1], &n)))
        return -1;
    r->req = PyLong_AsLong(args[2]);
    r->tokens = PyLong_AsLongLong(args[3]);
    r->page_size = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return -1;
    r->pages = page_data(args[0], r->state, n, &r->count);
    return r->pages == NULL ? -1 : 0;
}

/* read_clean(pages, state, req, tokens, page_size) -> bool: read_is_clean. Changes nothing. */
static PyObject *
read_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Read r;
    if (read_args(args, nargs, "read_clean", &r) < 0)
        return NULL;
    return PyBool_FromLong(read_is_clean(r.state, r.pages, r.count, r.req, r.tokens, r.page_size));
}

/* Page i of a refused read (see read_victims): STALE, FOREIGN or SOUND, and its victim. */
enum { SOUND = -1, STALE = 0, FOREIGN = 1 };

static inline int
read_kind(const Read *r, npy_intp i, int32_t *victim)
{
    const Page *page = &r->state[r->pages[i]];
    long long slots = i == r->count - 1 ? r->tokens - (long long)(r->count - 1) * r->page_size : r->page_size;
    int kind;
    if (page->owner != r->req) {
        kind = FOREIGN;
        *victim = page->writer != NOBODY ? page->writer : (page->owner > NOBODY ? page->owner : NOBODY);
    } else if (page->own != r->req || (long long)page->valid < slots) {
        kind = STALE;
        *victim = page->own == r->req ? page->prior : page->writer; /* own == req: it wrote too few slots */
    } else {
        return SOUND;
    }
    if (*victim == r->req)
        *victim = NOBODY;
    return kind;
}

/* read_victims(pages, state, req, tokens, page_size) -> (stale, stale_victims, foreign, foreign_victims)
 * The judgment of a read that read_clean refused, for a reader given no prefix pages in the
 * pool (ledger._read_slow's path when it has no share there; with one it stays in NumPy).
 * Page i is read in full but the last, of which tokens - (count - 1) * page_size slots are.
 * A page the reader owns is stale unless its own tag is the reader's and it holds the slots
 * read; its victim is the prior writer where the reader wrote fewer slots than it read, else
 * the writer. A page it does not own is foreign; its victim is the writer, or the owner
 * (live; an ended grant names nobody) of a page never written. A victim that is the reader
 * is NOBODY. Returns the pages (intp) and victims (int32) of each kind, in read order.
 * Changes nothing. */
static PyObject *
read_victims(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Read r;
    if (read_args(args, nargs, "read_victims", &r) < 0)
        return NULL;
    npy_intp found[2] = {0, 0}; /* STALE, FOREIGN */
    int32_t victim;
    for (npy_intp i = 0; i < r.count; i++) {
        int kind = read_kind(&r, i, &victim);
        if (kind != SOUND)
            found[kind]++;
    }
    PyObject *arrays[4] = {NULL, NULL, NULL, NULL}; /* stale, their victims, foreign, theirs */
    for (int a = 0; a < 4; a++) {
        npy_intp len = found[a / 2];
        arrays[a] = PyArray_SimpleNew(1, &len, a % 2 ? NPY_INT32 : NPY_INTP);
        if (arrays[a] == NULL) {
            for (int j = 0; j < a; j++)
                Py_DECREF(arrays[j]);
            return NULL;
        }
    }
    npy_intp *out_pages[2] = {PyArray_DATA((PyArrayObject *)arrays[0]), PyArray_DATA((PyArrayObject *)arrays[2])};
    int32_t *out_victims[2] = {PyArray_DATA((PyArrayObject *)arrays[1]), PyArray_DATA((PyArrayObject *)arrays[3])};
    npy_intp at[2] = {0, 0};
    for (npy_intp i = 0; i < r.count; i++) {
        int kind = read_kind(&r, i, &victim);
        if (kind == SOUND)
            continue;
        out_pages[kind][at[kind]] = r.pages[i];
        out_victims[kind][at[kind]++] = victim;
    }
    return Py_BuildValue("(NNNN)", arrays[0], arrays[1], arrays[2], arrays[3]);
}

/* mark_named(state, holder_req, named) -> None
 * Sets named[r] for every request r a page's tags name: its writer, prior writer, own tag,
 * owner (live or ended: ~owner) and the holder of each kind of hold still on it. One pass
 * over the records (the ledger's scan before forgetting requests; per field in NumPy it
 * read each record once a field). IndexError for a tag beyond named (a corrupt state). */
static PyObject *
mark_named(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 3, "mark_named") < 0)
        return NULL;
    npy_intp n;
    const Page *state = pool_data(args[0], &n);
    if (state == NULL)
        return NULL;
    PyArrayObject *holders = (PyArrayObject *)args[1], *marks = (PyArrayObject *)args[2];
    if (!PyArray_Check(args[1]) || !PyArray_EquivTypenums(PyArray_TYPE(holders), NPY_INT32) ||
        PyArray_NDIM(holders) != 2 || PyArray_DIM(holders, 0) != HOLD_KINDS || PyArray_DIM(holders, 1) != n ||
        !PyArray_IS_C_CONTIGUOUS(holders)) {
        PyErr_SetString(PyExc_TypeError, "holder_req: a contiguous (kinds, pages) int32 array expected");
        return NULL;
    }
    if (!PyArray_Check(args[2]) || !PyArray_EquivTypenums(PyArray_TYPE(marks), NPY_BOOL) ||
        PyArray_NDIM(marks) != 1 || !PyArray_IS_C_CONTIGUOUS(marks) || !PyArray_ISWRITEABLE(marks)) {
        PyErr_SetString(PyExc_TypeError, "named: a writable contiguous 1-d bool array expected");
        return NULL;
    }
    const int32_t *holder = PyArray_DATA(holders);
    npy_bool *named = PyArray_DATA(marks);
    uint32_t limit = (uint32_t)PyArray_DIM(marks, 0);
    for (npy_intp p = 0; p < n; p++) {
        const Page *page = &state[p];
        uint32_t tags[4 + HOLD_KINDS] = {(uint32_t)page->writer, (uint32_t)page->prior, (uint32_t)page->own,
                                         (uint32_t)(page->owner >= 0 ? page->owner : ~page->owner)};
        int count = 4;
        for (int k = 0; k < HOLD_KINDS; k++)
            if (page->holds[k] > 0)
                tags[count++] = (uint32_t)holder[k * n + p];
        for (int t = 0; t < count; t++) {
            if (tags[t] >= limit) /* a negative tag, as uint32, too */
                return PyErr_Format(PyExc_IndexError, "page %zd names request %d, beyond %u", (Py_ssize_t)p,
                                    (int32_t)tags[t], limit);
            named[tags[t]] = 1;
        }
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- events read from their bytes */

enum { EV_ALLOC = 16, EV_WRITE = 17, EV_FREE = 18, EV_READ = 22 };

typedef struct {
    const uint8_t *data;
    Py_ssize_t pos, end;
} Reader;

/* The next field's number and wire type; 0 at the end, -1 when the bytes are not a message. */
static int
next_field(Reader *r, uint64_t *number, int *wire)
{
    uint64_t key;
    if (r->pos >= r->end)
        return 0;
    if (varint(r->data, r->end, &r->pos, &key) < 0 || (key >> 3) == 0)
        return -1;
    *number = key >> 3;
    *wire = (int)(key & 7);
    return 1;
}

/* Skips a field's value of wire type `wire`; -1 when it runs past the end (or is a group). */
static int
skip_value(Reader *r, int wire)
{
    uint64_t value;
    switch (wire) {
    case 0:
        return varint(r->data, r->end, &r->pos, &value);
    case 1:
        r->pos += 8;
        break;
    case 2:
        if (varint(r->data, r->end, &r->pos, &value) < 0 || value > (uint64_t)(r->end - r->pos))
            return -1;
        r->pos += (Py_ssize_t)value;
        break;
    case 5:
        r->pos += 4;
        break;
    default:
        return -1;
    }
    return r->pos <= r->end ? 0 : -1;
}

/* A length-delimited value: its bytes [*start, *end); -1 when it runs past the end. */
static int
span(Reader *r, Py_ssize_t *start, Py_ssize_t *end)
{
    uint64_t size;
    if (varint(r->data, r->end, &r->pos, &size) < 0 || size > (uint64_t)(r->end - r->pos))
        return -1;
    *start = r->pos;
    r->pos += (Py_ssize_t)size;
    *end = r->pos;
    return 0;
}

/* The fields of an alloc, write or free payload, or of a read's entry (tokens: field 4),
 * in [r->pos, r->end): req (1), pool (2), pages (3, left to page_list); 0 if plain, -1 if
 * anything else is there (a field twice, a wire type not its own, a value beyond uint32, a
 * write's slots). */
static int
payload(Reader r, int kind, Py_ssize_t *req_start, Py_ssize_t *req_end, uint64_t *pool, uint64_t *tokens)
{
    uint64_t number;
    int wire, got, seen = 0;
    while ((got = next_field(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 2 && !(seen & 1)) {
            if (span(&r, req_start, req_end) < 0)
                return -1;
            seen |= 1;
        } else if (number == 2 && wire == 0 && !(seen & 2)) {
            if (varint(r.data, r.end, &r.pos, pool) < 0 || *pool > UINT32_MAX)
                return -1;
            seen |= 2;
        } else if (number == 3 && (wire == 0 || wire == 2)) {
            if (skip_value(&r, wire) < 0)
                return -1;
        } else if (number == 4 && kind == EV_READ && wire == 0 && !(seen & 4)) {
            if (varint(r.data, r.end, &r.pos, tokens) < 0)
                return -1;
            seen |= 4;
        } else if (number <= 4) { /* a known field twice, a wire type not its own, slots */
            return -1;
        } else if (skip_value(&r, wire) < 0) {
            return -1;
        }
    }
    return got;
}

/* An event of the plain shape event_head describes, located in its bytes. */
typedef struct {
    int kind; /* EV_ALLOC, EV_WRITE, EV_FREE or EV_READ */
    uint64_t seq, ts, pool, tokens;
    Py_ssize_t node_start, node_end, req_start, req_end;
    Py_ssize_t start, end; /* the payload (of a read: its one entry), whose field 3 lists the pages */
} Head;

/* The head of an event of the plain shape (see event_head) in data[0, len): 0, or -1 for
 * anything else. */
static int
parse_head(const uint8_t *data, Py_ssize_t len, Head *h)
{
    Reader r = {data, 0, len};
    uint64_t number;
    int wire, got, seen = 0;
    memset(h, 0, sizeof(*h));
    while ((got = next_field(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 2 && !(seen & 1)) {
            if (span(&r, &h->node_start, &h->node_end) < 0)
                return -1;
            seen |= 1;
        } else if (number == 2 && wire == 0 && !(seen & 2)) {
            if (varint(r.data, r.end, &r.pos, &h->seq) < 0)
                return -1;
            seen |= 2;
        } else if (number == 3 && wire == 0 && !(seen & 4)) {
            if (varint(r.data, r.end, &r.pos, &h->ts) < 0)
                return -1;
            seen |= 4;
        } else if ((number == EV_ALLOC || number == EV_WRITE || number == EV_FREE || number == EV_READ) &&
                   wire == 2 && !h->kind) {
            if (span(&r, &h->start, &h->end) < 0)
                return -1;
            h->kind = (int)number;
        } else if (number <= 3 || (number >= 10 && number <= 28)) {
            return -1; /* a field twice, a wire type not its own, another payload */
        } else if (skip_value(&r, wire) < 0) {
            return -1;
        }
    }
    if (got < 0 || !h->kind)
        return -1;
    if (h->kind == EV_READ) { /* Read: exactly one entry (field 1) */
        Reader entries = {r.data, h->start, h->end};
        int n = 0;
        while ((got = next_field(&entries, &number, &wire)) > 0) {
            if (number == 1 && wire == 2) {
                if (n++ || span(&entries, &h->start, &h->end) < 0)
                    return -1;
            } else if (number == 1 || skip_value(&entries, wire) < 0) {
                return -1;
            }
        }
        if (got < 0 || n != 1)
            return -1;
    }
    Reader fields = {r.data, h->start, h->end};
    return payload(fields, h->kind, &h->req_start, &h->req_end, &h->pool, &h->tokens) < 0 ? -1 : 0;
}

static PyObject *last_node; /* the node of the last event decoded: most events repeat it */

/* event_head(body) -> (kind, node, seq, ts_ns, req, pool, tokens, start, end) or None
 * An Event read straight from its bytes, for the events every request makes: alloc (16),
 * write (17) without slots, free (18) and a read (22) of one entry; [start, end) are the
 * bytes of the payload (of the read's entry), whose field 3 lists the pages (page_list
 * reads them there). None for anything other than that plain shape (another payload, a
 * field given twice, a wire type not its own, invalid UTF-8, a value beyond its type,
 * malformed bytes): the caller then parses the event with protobuf, the authority on what
 * the bytes mean, so this never decides anything protobuf would decide otherwise. */
static PyObject *
event_head(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 1, "event_head") < 0)
        return NULL;
    if (!PyBytes_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "event_head: bytes expected, got %.80s", Py_TYPE(args[0])->tp_name);
    Head h;
    const char *base = PyBytes_AS_STRING(args[0]);
    if (parse_head((const uint8_t *)base, PyBytes_GET_SIZE(args[0]), &h) < 0)
        Py_RETURN_NONE;
    PyObject *node;
    Py_ssize_t node_len = h.node_end - h.node_start;
    if (last_node != NULL && PyUnicode_GET_LENGTH(last_node) == node_len && PyUnicode_IS_ASCII(last_node) &&
        memcmp(PyUnicode_DATA(last_node), base + h.node_start, (size_t)node_len) == 0) {
        node = Py_NewRef(last_node);
    } else {
        node = PyUnicode_DecodeUTF8(base + h.node_start, node_len, NULL);
        if (node == NULL) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        Py_XSETREF(last_node, Py_NewRef(node));
    }
    PyObject *req = PyUnicode_DecodeUTF8(base + h.req_start, h.req_end - h.req_start, NULL);
    if (req == NULL) {
        PyErr_Clear();
        Py_DECREF(node);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iNKLNKKnn)", h.kind, node, (unsigned long long)h.seq, (long long)(int64_t)h.ts, req,
                         (unsigned long long)h.pool, (unsigned long long)h.tokens, h.start, h.end);
}

/* split_runs(bodies, span_ns, run_max) -> [(start, stop, node, seq, ts_ns, req, named), ...] or None
 * The audit store's rows for consecutive accepted events of one node (daemon/store.py rows_of,
 * which this does in C for the events of the plain shape event_head reads): each row takes the
 * events from its first on while their time lies within span_ns after the first's (none
 * earlier), at most run_max. A row of one event carries its request (`req`, `named` empty); a
 * longer one the distinct requests its events name, sorted (`named`, `req` ""); node, seq and
 * ts_ns are its first event's. None if any event is not of that shape: the caller then reads
 * them all with protobuf. */
static PyObject *
split_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 3, "split_runs") < 0)
        return NULL;
    long long span_ns = PyLong_AsLongLong(args[1]);
    Py_ssize_t run_max = PyLong_AsSsize_t(args[2]);
    if ((span_ns == -1 || run_max == -1) && PyErr_Occurred())
        return NULL;
    if (span_ns < 0 || run_max < 1)
        return PyErr_Format(PyExc_ValueError, "split_runs: span_ns %lld and run_max %zd", span_ns, run_max);
    PyObject *seq = PySequence_Fast(args[0], "split_runs: a sequence of bytes expected");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *rows = NULL, *names = NULL;
    Head *heads = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Head));
    if (heads == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "split_runs: bytes expected, got %.80s", Py_TYPE(items[i])->tp_name);
            goto done;
        }
        if (parse_head((const uint8_t *)PyBytes_AS_STRING(items[i]), PyBytes_GET_SIZE(items[i]), &heads[i]) < 0)
            goto plain; /* not the plain shape: protobuf reads them */
    }
    rows = PyList_New(0);
    if (rows == NULL)
        goto done;
    for (Py_ssize_t start = 0; start < n;) {
        int64_t t0 = (int64_t)heads[start].ts;
        Py_ssize_t stop = start + 1, last = n - start > run_max ? start + run_max : n;
        while (stop < last) {
            int64_t t = (int64_t)heads[stop].ts;
            if (t < t0 || (uint64_t)t - (uint64_t)t0 > (uint64_t)span_ns)
                break;
            stop++;
        }
        const char *first = PyBytes_AS_STRING(items[start]);
        const Head *h = &heads[start];
        PyObject *node = PyUnicode_DecodeUTF8(first + h->node_start, h->node_end - h->node_start, NULL);
        PyObject *req = NULL, *named = NULL;
        if (stop - start == 1) {
            req = PyUnicode_DecodeUTF8(first + h->req_start, h->req_end - h->req_start, NULL);
            named = PyTuple_New(0);
        } else {
            req = PyUnicode_FromStringAndSize("", 0);
            names = PySet_New(NULL);
            const char *prev = NULL;
            Py_ssize_t prev_len = -1;
            for (Py_ssize_t k = start; names != NULL && k < stop; k++) {
                const char *name = PyBytes_AS_STRING(items[k]) + heads[k].req_start;
                Py_ssize_t len = heads[k].req_end - heads[k].req_start;
                if (len == 0 || (len == prev_len && memcmp(name, prev, (size_t)len) == 0))
                    continue; /* no request, or the one before (a request's events come together) */
                PyObject *one = PyUnicode_DecodeUTF8(name, len, NULL);
                if (one == NULL || PySet_Add(names, one) < 0)
                    Py_CLEAR(names);
                Py_XDECREF(one);
                prev = name;
                prev_len = len;
            }
            if (names != NULL) {
                PyObject *sorted = PySequence_List(names);
                if (sorted != NULL && PyList_Sort(sorted) == 0)
                    named = PyList_AsTuple(sorted);
                Py_XDECREF(sorted);
            }
            Py_CLEAR(names);
        }
        PyObject *row = NULL;
        if (node != NULL && req != NULL && named != NULL)
            row = Py_BuildValue("(nnOKLOO)", start, stop, node, (unsigned long long)h->seq, (long long)t0, req, named);
        Py_XDECREF(node);
        Py_XDECREF(req);
        Py_XDECREF(named);
        if (row == NULL || PyList_Append(rows, row) < 0) {
            Py_XDECREF(row);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                goto plain; /* protobuf says what such bytes are */
            Py_CLEAR(rows);
            goto done;
        }
        Py_DECREF(row);
        start = stop;
    }
    goto done;
plain:
    PyErr_Clear();
    Py_CLEAR(rows);
    rows = Py_NewRef(Py_None);
done:
    PyMem_Free(heads);
    Py_DECREF(seq);
    return rows;
}

/* ---------------------------------------------------------------- runs of clean events */

#define PAGES_FIELD 3 /* `pages` in Alloc, Write, Free and ReadEntry (ledger.py: _HOT_PAGES) */

/* Names of the ledger's attributes apply_clean reads and writes, interned at import. */
static PyObject *s_nodes, *s_pools, *s_last_seq, *s_last_ts_ns, *s_req_index, *s_requests, *s_applied,
    *s_next_sweep, *s_posted, *s_wire_pending, *s_stats, *s_events, *s_page_transitions, *s_missing,
    *s_last_missing, *s_pages, *s_state, *s_num_pages, *s_page_size, *s_regions, *s_live, *s_last, *s_retired,
    *s_bootstrap, *s_history, *s_granted_pages, *s_written_pages, *s_freed_pages, *s_reads, *s_ctx_node,
    *s_ctx_seq, *s_ctx_ts, *s_request_fn;
static PyObject *kind_names[4]; /* "alloc", "write", "free", "read": LedgerStats.events' keys */

static int
kind_index(int kind)
{
    return kind == EV_ALLOC ? 0 : kind == EV_WRITE ? 1 : kind == EV_FREE ? 2 : 3;
}

/* The pool of the events being applied (they rarely change pools within a batch). */
typedef struct {
    PyObject *key;   /* its id as a Python int (NULL: none yet) */
    uint64_t id;
    PyObject *array; /* pool.pages.state, kept alive while its records are used */
    PyObject *live;  /* pool.live: request index -> pages it holds */
    Page *state;
    npy_intp num_pages;
    long long page_size;
    int timed; /* the pool reported its memory (regions): grants and frees record `since` */
} PoolAt;

/* What apply_clean works with: the ledger's parts (new references) and what the applied
 * events changed, written back to the ledger once at the end. */
typedef struct {
    PyObject *ledger, *node_name, *ended, *node, *pools, *req_index, *requests;
    const char *name;
    Py_ssize_t name_len, grant_runs;
    int wire; /* transfers wait for a probe's verdict: frees and reads are Python's */
    PoolAt pool;
    uint64_t last_seq;
    int64_t last_ts;
    long long applied, next_sweep, transitions, missing, last_missing;
    Py_ssize_t kinds[4];
    int order[4], n_kinds;
} Run;

static void
pool_release(PoolAt *p)
{
    Py_CLEAR(p->key);
    Py_CLEAR(p->array);
    Py_CLEAR(p->live);
}

/* The run's pool becomes pool `id` of the node: 1, 0 if the node has no such pool, -1 with
 * an exception. */
static int
pool_at(Run *c, uint64_t id)
{
    PoolAt *p = &c->pool;
    if (p->key != NULL && p->id == id)
        return 1;
    pool_release(p);
    PyObject *key = PyLong_FromUnsignedLongLong(id);
    if (key == NULL)
        return -1;
    PyObject *pool = PyDict_GetItemWithError(c->pools, key); /* borrowed */
    if (pool == NULL) {
        Py_DECREF(key);
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *pages = NULL, *array = NULL, *num = NULL, *size = NULL, *regions = NULL, *live = NULL;
    int rc = -1;
    if ((pages = PyObject_GetAttr(pool, s_pages)) && (array = PyObject_GetAttr(pages, s_state)) &&
        (num = PyObject_GetAttr(pages, s_num_pages)) && (size = PyObject_GetAttr(pages, s_page_size)) &&
        (regions = PyObject_GetAttr(pool, s_regions)) && (live = PyObject_GetAttr(pool, s_live))) {
        npy_intp records;
        p->state = pool_data(array, &records);
        p->num_pages = PyLong_AsSsize_t(num);
        p->page_size = PyLong_AsLongLong(size);
        if (p->state != NULL && !PyErr_Occurred()) {
            if (records != p->num_pages || p->page_size <= 0 || !PyDict_Check(live)) {
                PyErr_SetString(PyExc_TypeError, "apply_clean: a pool's records, size or live counts are not sound");
            } else {
                p->key = Py_NewRef(key);
                p->id = id;
                p->array = Py_NewRef(array);
                p->live = Py_NewRef(live);
                p->timed = regions != Py_None;
                rc = 1;
            }
        }
    }
    Py_DECREF(key);
    Py_XDECREF(pages);
    Py_XDECREF(array);
    Py_XDECREF(num);
    Py_XDECREF(size);
    Py_XDECREF(regions);
    Py_XDECREF(live);
    return rc;
}

/* o.name = value (a new reference, consumed); -1 with an exception. */
static int
set_new(PyObject *o, PyObject *name, PyObject *value)
{
    if (value == NULL)
        return -1;
    int rc = PyObject_SetAttr(o, name, value);
    Py_DECREF(value);
    return rc;
}

/* o.name += delta (an int attribute); -1 with an exception. */
static int
add_to(PyObject *o, PyObject *name, long long delta)
{
    PyObject *value = PyObject_GetAttr(o, name);
    if (value == NULL)
        return -1;
    PyObject *d = PyLong_FromLongLong(delta);
    PyObject *sum = d ? PyNumber_Add(value, d) : NULL;
    Py_DECREF(value);
    Py_XDECREF(d);
    return set_new(o, name, sum);
}

/* counts[key] = counts.get(key, 0) + delta; -1 with an exception. */
static int
add_item(PyObject *counts, PyObject *key, long long delta)
{
    PyObject *value = PyDict_GetItemWithError(counts, key); /* borrowed */
    if (value == NULL && PyErr_Occurred())
        return -1;
    PyObject *d = PyLong_FromLongLong(delta);
    PyObject *sum = d == NULL ? NULL : value == NULL ? Py_NewRef(d) : PyNumber_Add(value, d);
    Py_XDECREF(d);
    if (sum == NULL)
        return -1;
    int rc = PyDict_SetItem(counts, key, sum);
    Py_DECREF(sum);
    return rc;
}

/* One event of the run: 1 if it was the clean common case and is applied, 0 if it is not
 * (nothing changed: it is for ledger.py), -1 with an exception. Clean: an alloc, write
 * (whole pages), free or one-entry read of the run's node, next in its sequence, of a pool
 * it reported, its pages valid (and distinct, but a read's), of a request the ledger knows,
 * in use (not retired) and not ended (a free may come after the end), whose pages need no
 * judgment (grant_busy, not_owned, read_is_clean); an alloc of a request with no bootstrap
 * and fewer than grant_runs grants kept on that pool; no sweep due after it. Applied as
 * ledger.py's handlers apply it, in the same order (the request's `last`, its pages, its
 * counts), so that a snapshot after either is the same to the byte. */
static int
clean_event(Run *c, PyObject *body)
{
    Head h;
    if (!PyBytes_Check(body))
        return 0;
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(body);
    if (parse_head(data, PyBytes_GET_SIZE(body), &h) < 0 || h.node_end - h.node_start != c->name_len ||
        memcmp(data + h.node_start, c->name, (size_t)c->name_len) != 0 || h.seq == 0 || h.seq <= c->last_seq ||
        c->applied + 1 == c->next_sweep || h.req_end == h.req_start ||
        ((h.kind == EV_FREE || h.kind == EV_READ) && c->wire))
        return 0;
    int found = pool_at(c, h.pool);
    if (found <= 0)
        return found;
    PoolAt *p = &c->pool;
    PyObject *array = decode_pages(data + h.start, h.end - h.start, PAGES_FIELD, p->num_pages, p->state,
                                   h.kind != EV_READ); /* a block table may name a page twice */
    if (array == NULL) {
        PyErr_Clear(); /* out of range, listed twice, malformed: ledger.py words the error */
        return 0;
    }
    const npy_intp *pages = PyArray_DATA((PyArrayObject *)array);
    npy_intp count = PyArray_DIM((PyArrayObject *)array, 0);
    int rc = 0;
    PyObject *req = NULL, *r = NULL, *history = NULL, *key = NULL, *grants = NULL;
    if (h.kind == EV_READ) { /* the pages the context covers (a block table may be longer) */
        uint64_t need = h.tokens / (uint64_t)p->page_size + (h.tokens % (uint64_t)p->page_size != 0);
        if (need > (uint64_t)count)
            goto out;
        count = (npy_intp)need;
    }
    req = PyUnicode_DecodeUTF8((const char *)data + h.req_start, h.req_end - h.req_start, NULL);
    if (req == NULL) {
        PyErr_Clear();
        goto out;
    }
    PyObject *idx = PyDict_GetItemWithError(c->req_index, req); /* borrowed; NULL: a new request */
    if (idx == NULL && !PyErr_Occurred() && h.kind == EV_ALLOC) {
        /* A request's first event is its first grant: ledger.py makes the request (one place
         * does), as its alloc handler would at this point, whatever the event turns out to be. */
        PyObject *made = NULL;
        if (set_new(c->ledger, s_applied, PyLong_FromLongLong(c->applied)) == 0) /* it reads the count */
            made = PyObject_CallMethodObjArgs(c->ledger, s_request_fn, req, kind_names[0], NULL);
        Py_XDECREF(made);
        idx = made ? PyDict_GetItemWithError(c->req_index, req) : NULL;
        if (idx == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "apply_clean: Ledger._request made no request");
    }
    if (idx == NULL) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto out;
    }
    Py_ssize_t at = PyLong_AsSsize_t(idx);
    if (at == -1 && PyErr_Occurred()) {
        rc = -1;
        goto out;
    }
    if (at <= NOBODY || at >= PyList_GET_SIZE(c->requests) || PyList_GET_ITEM(c->requests, at) == Py_None)
        goto out;
    r = Py_NewRef(PyList_GET_ITEM(c->requests, at));
    PyObject *flag = PyObject_GetAttr(r, s_retired);
    int retired = flag ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    if (retired != 0) {
        rc = retired < 0 ? -1 : 0;
        goto out;
    }
    if (h.kind != EV_FREE) {
        PyObject *state = PyObject_GetAttr(r, s_state);
        int ended = state ? PySequence_Contains(c->ended, state) : -1;
        Py_XDECREF(state);
        if (ended != 0) {
            rc = ended < 0 ? -1 : 0;
            goto out;
        }
    }
    switch (h.kind) {
    case EV_ALLOC: {
        PyObject *bootstrap = PyObject_GetAttr(r, s_bootstrap);
        if (bootstrap == NULL) {
            rc = -1;
            goto out;
        }
        int plain = bootstrap == Py_None;
        Py_DECREF(bootstrap);
        if (!plain || !(history = PyObject_GetAttr(r, s_history)) || !PyDict_Check(history) ||
            !(key = PyTuple_Pack(2, c->node_name, p->key))) {
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        grants = PyDict_GetItemWithError(history, key);
        if (grants == NULL && PyErr_Occurred()) {
            rc = -1;
            goto out;
        }
        Py_XINCREF(grants);
        if ((grants != NULL && (!PyList_Check(grants) || PyList_GET_SIZE(grants) >= c->grant_runs)) ||
            grant_busy(p->state, pages, count))
            goto out;
        break;
    }
    case EV_WRITE:
        if (not_owned(p->state, pages, count, (long)at))
            goto out;
        break;
    case EV_FREE:
        if (not_owned(p->state, pages, count, (long)at))
            goto out;
        if (count && PyDict_GetItemWithError(p->live, idx) == NULL) { /* ledger.py's to handle */
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        break;
    default:
        if (!read_is_clean(p->state, pages, count, (long)at, (long long)h.tokens, p->page_size))
            goto out;
    }
    /* Clean: applied from here on. */
    rc = -1;
    if (set_new(r, s_last, PyLong_FromLongLong(c->applied)) < 0)
        goto out;
    switch (h.kind) {
    case EV_ALLOC:
        grant_pages(p->state, pages, count, (long)at, (int64_t)h.ts, p->timed);
        if (grants != NULL) {
            if (PyList_Append(grants, array) < 0)
                goto out;
        } else {
            PyObject *one = PyList_New(1);
            if (one == NULL)
                goto out;
            PyList_SET_ITEM(one, 0, Py_NewRef(array));
            int set = PyDict_SetItem(history, key, one);
            Py_DECREF(one);
            if (set < 0)
                goto out;
        }
        if (add_item(p->live, idx, count) < 0 || add_to(r, s_granted_pages, count) < 0)
            goto out;
        break;
    case EV_WRITE:
        land_pages(p->state, pages, count, (long)at, NULL, (uint32_t)p->page_size);
        if (add_to(r, s_written_pages, count) < 0)
            goto out;
        break;
    case EV_FREE:
        end_pages(p->state, pages, count, (long)at, (int64_t)h.ts, p->timed);
        if ((count && add_item(p->live, idx, -(long long)count) < 0) || add_to(r, s_freed_pages, count) < 0)
            goto out;
        break;
    default:
        if (add_to(r, s_reads, 1) < 0)
            goto out;
    }
    int k = kind_index(h.kind);
    if (!c->kinds[k]++)
        c->order[c->n_kinds++] = k;
    c->transitions += count;
    c->last_missing = (long long)(h.seq - c->last_seq - 1);
    c->missing += c->last_missing;
    c->last_seq = h.seq;
    c->last_ts = (int64_t)h.ts;
    c->applied += 1;
    rc = 1;
out:
    Py_DECREF(array);
    Py_XDECREF(req);
    Py_XDECREF(r);
    Py_XDECREF(history);
    Py_XDECREF(key);
    Py_XDECREF(grants);
    return rc;
}

/* What the applied events did to the node, the ledger's counts and its stats, as their
 * _event_begin and _event_end would have left them. */
static int
write_back(Run *c)
{
    if (c->n_kinds == 0)
        return 0;
    PyObject *stats = PyObject_GetAttr(c->ledger, s_stats);
    PyObject *events = stats ? PyObject_GetAttr(stats, s_events) : NULL;
    int rc = -1;
    if (events == NULL || set_new(c->node, s_last_seq, PyLong_FromUnsignedLongLong(c->last_seq)) < 0 ||
        set_new(c->node, s_last_ts_ns, PyLong_FromLongLong(c->last_ts)) < 0 ||
        set_new(c->ledger, s_applied, PyLong_FromLongLong(c->applied)) < 0 ||
        set_new(c->ledger, s_last_missing, PyLong_FromLongLong(c->last_missing)) < 0 ||
        add_to(stats, s_page_transitions, c->transitions) < 0 || add_to(stats, s_missing, c->missing) < 0 ||
        PyObject_SetAttr(c->ledger, s_ctx_node, c->node_name) < 0 ||
        set_new(c->ledger, s_ctx_seq, PyLong_FromUnsignedLongLong(c->last_seq)) < 0 ||
        set_new(c->ledger, s_ctx_ts, PyLong_FromLongLong(c->last_ts)) < 0)
        goto out;
    if (!PyDict_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "apply_clean: stats.events is not a Counter");
        goto out;
    }
    for (int j = 0; j < c->n_kinds; j++) /* a Counter: keys in the order the kinds first came */
        if (add_item(events, kind_names[c->order[j]], c->kinds[c->order[j]]) < 0)
            goto out;
    rc = 0;
out:
    Py_XDECREF(stats);
    Py_XDECREF(events);
    return rc;
}

/* apply_clean(ledger, bodies, start, stop, node, ended, grant_runs) -> int
 * Applies bodies[start:stop] (serialized events of `node`'s stream) to the ledger, in
 * order, for as long as each is the clean common case (clean_event), exactly as
 * Ledger.apply_serialized(body, node) would; returns the index of the first it did not
 * apply (stop when it applied them all), which the caller then gives to apply_serialized
 * (a finding, an error, a new request, anything less common). `ended`: the request states
 * that end one (ledger.ENDED); grant_runs: ledger.GRANT_RUNS. Nothing applies while a
 * probe's posted writes wait for this node's events (their verdict is Python's). */
static PyObject *
apply_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 7, "apply_clean") < 0)
        return NULL;
    Run c;
    memset(&c, 0, sizeof(c));
    c.ledger = args[0];
    c.node_name = args[4];
    c.ended = args[5];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    c.grant_runs = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyUnicode_Check(c.node_name))
        return PyErr_Format(PyExc_TypeError, "apply_clean: node must be str, not %.80s",
                            Py_TYPE(c.node_name)->tp_name);
    if (!(c.name = PyUnicode_AsUTF8AndSize(c.node_name, &c.name_len)))
        return NULL;
    Py_ssize_t i = start;
    PyObject *result = NULL, *nodes = NULL, *posted = NULL, *wire = NULL, *value = NULL;
    if (!(nodes = PyObject_GetAttr(c.ledger, s_nodes)) || !PyDict_Check(nodes))
        goto done;
    c.node = PyDict_GetItemWithError(nodes, c.node_name);
    if (c.node == NULL) { /* its first event: ledger.py makes the node */
        if (!PyErr_Occurred())
            result = PyLong_FromSsize_t(start);
        goto done;
    }
    Py_INCREF(c.node);
    int waiting = (posted = PyObject_GetAttr(c.ledger, s_posted)) ? PySequence_Contains(posted, c.node_name) : -1;
    if (waiting != 0) {
        if (waiting > 0)
            result = PyLong_FromSsize_t(start);
        goto done;
    }
    if (!(wire = PyObject_GetAttr(c.ledger, s_wire_pending)) || (c.wire = PyObject_IsTrue(wire)) < 0 ||
        !(c.pools = PyObject_GetAttr(c.node, s_pools)) || !(c.req_index = PyObject_GetAttr(c.ledger, s_req_index)) ||
        !(c.requests = PyObject_GetAttr(c.ledger, s_requests)))
        goto done;
    if (!PyDict_Check(c.pools) || !PyDict_Check(c.req_index) || !PyList_Check(c.requests)) {
        PyErr_SetString(PyExc_TypeError, "apply_clean: not a Ledger");
        goto done;
    }
    if (!(value = PyObject_GetAttr(c.node, s_last_seq)) || ((c.last_seq = PyLong_AsUnsignedLongLong(value)),
                                                           PyErr_Occurred()))
        goto done;
    Py_CLEAR(value);
    if (!(value = PyObject_GetAttr(c.ledger, s_applied)) || ((c.applied = PyLong_AsLongLong(value)), PyErr_Occurred()))
        goto done;
    Py_CLEAR(value);
    if (!(value = PyObject_GetAttr(c.ledger, s_next_sweep)) ||
        ((c.next_sweep = PyLong_AsLongLong(value)), PyErr_Occurred()))
        goto done;
    Py_CLEAR(value);
    int failed = 0;
    for (; i < stop; i++) {
        PyObject *body = PySequence_GetItem(args[1], i);
        int applied = body ? clean_event(&c, body) : -1;
        Py_XDECREF(body);
        if (applied <= 0) {
            failed = applied < 0;
            break;
        }
    }
    /* What was applied is written back even when an event failed (a bug, or out of memory),
     * so the ledger stays whole; that error is then raised. */
    PyObject *type, *error, *trace;
    PyErr_Fetch(&type, &error, &trace);
    if (write_back(&c) < 0) {
        Py_XDECREF(type);
        Py_XDECREF(error);
        Py_XDECREF(trace);
        goto done;
    }
    PyErr_Restore(type, error, trace);
    if (!failed)
        result = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(nodes);
    Py_XDECREF(posted);
    Py_XDECREF(wire);
    Py_XDECREF(value);
    Py_XDECREF(c.node);
    Py_XDECREF(c.pools);
    Py_XDECREF(c.req_index);
    Py_XDECREF(c.requests);
    pool_release(&c.pool);
    return result;
}

static PyMethodDef methods[] = {
    {"page_list", (PyCFunction)(void (*)(void))page_list, METH_FASTCALL, "An event's page list, checked."},
    {"grant", (PyCFunction)(void (*)(void))grant, METH_FASTCALL, "Pages granted to a request."},
    {"land", (PyCFunction)(void (*)(void))land, METH_FASTCALL, "A request's KV lands in pages."},
    {"end_grant", (PyCFunction)(void (*)(void))end_grant, METH_FASTCALL, "A request's grant ends."},
    {"read_clean", (PyCFunction)(void (*)(void))read_clean, METH_FASTCALL, "The clean read check."},
    {"read_victims", (PyCFunction)(void (*)(void))read_victims, METH_FASTCALL, "A refused read judged."},
    {"mark_named", (PyCFunction)(void (*)(void))mark_named, METH_FASTCALL, "Requests the page tags name."},
    {"event_head", (PyCFunction)(void (*)(void))event_head, METH_FASTCALL, "A common event read from its bytes."},
    {"apply_clean", (PyCFunction)(void (*)(void))apply_clean, METH_FASTCALL, "A run of clean common events applied."},
    {"split_runs", (PyCFunction)(void (*)(void))split_runs, METH_FASTCALL, "The store's rows of accepted events."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.ledger._hot",
    .m_doc = "The ledger's hot path over the page arrays.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__hot(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    struct {
        PyObject **name;
        const char *text;
    } names[] = {
        {&s_nodes, "nodes"}, {&s_pools, "pools"}, {&s_last_seq, "last_seq"}, {&s_last_ts_ns, "last_ts_ns"},
        {&s_req_index, "_req_index"}, {&s_requests, "requests"}, {&s_applied, "_applied"},
        {&s_next_sweep, "_next_sweep"}, {&s_posted, "_posted"}, {&s_wire_pending, "_wire_pending"},
        {&s_stats, "stats"}, {&s_events, "events"}, {&s_page_transitions, "page_transitions"},
        {&s_missing, "missing"}, {&s_last_missing, "last_missing"}, {&s_pages, "pages"}, {&s_state, "state"},
        {&s_num_pages, "num_pages"}, {&s_page_size, "page_size"}, {&s_regions, "regions"}, {&s_live, "live"},
        {&s_last, "last"}, {&s_retired, "retired"}, {&s_bootstrap, "bootstrap"}, {&s_history, "history"},
        {&s_granted_pages, "granted_pages"}, {&s_written_pages, "written_pages"}, {&s_freed_pages, "freed_pages"},
        {&s_reads, "reads"}, {&s_ctx_node, "_node"}, {&s_ctx_seq, "_seq"}, {&s_ctx_ts, "_ts"}, {&s_request_fn, "_request"},
        {&kind_names[0], "alloc"}, {&kind_names[1], "write"}, {&kind_names[2], "free"}, {&kind_names[3], "read"},
    };
    for (size_t j = 0; j < sizeof(names) / sizeof(names[0]); j++)
        if (!(*names[j].name = PyUnicode_InternFromString(names[j].text))) {
            Py_DECREF(m);
            return NULL;
        }
    /* PAGE from the struct itself: the Python side can never disagree with the layout. */
#define OFFSET(field) ((Py_ssize_t)offsetof(Page, field))
    PyObject *spec = Py_BuildValue(
        "{s:[sssssssssss],s:[sssssssssss],s:[nnnnnnnnnnn],s:n}", "names", "owner", "own", "use", "gen", "writer",
        "wgen", "valid", "prior", "since", "holds", "seen", "formats", "<i4", "<i4", "<u4", "<u4", "<i4", "<u4",
        "<u4", "<i4", "<i8", "(4,)<u4", "u1", "offsets", OFFSET(owner), OFFSET(own),
        OFFSET(use), OFFSET(gen), OFFSET(writer), OFFSET(wgen),
        OFFSET(valid), OFFSET(prior), OFFSET(since), OFFSET(holds),
        OFFSET(seen), "itemsize", (Py_ssize_t)sizeof(Page));
#undef OFFSET
    if (spec == NULL || !PyArray_DescrConverter(spec, &page_descr) ||
        PyModule_AddObjectRef(m, "PAGE", (PyObject *)page_descr) < 0) {
        Py_XDECREF(spec);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(spec);
    return m;
}
