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
        if (state != NULL) {
            if (state[page].seen) {
                raise_page(PyExc_ValueError, page);
                break;
            }
            state[page].seen = 1;
        }
    }
    if (state != NULL)
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

/* grant(pages, state, req, ts, judged) -> busy
 * Counts the pages still in use (a live grant or a hold: handed out early). If none, or once
 * the ledger has judged them (judged true), grants every page to req: use = 1 + its holds
 * (1 for a page not in use), gen + 1, owner req, own NOBODY, prior = writer, since = ts
 * (unless ts is None). Else changes nothing. Returns the count. */
static PyObject *
grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Update u;
    if (update_args(args, nargs, "grant", &u) < 0)
        return NULL;
    long busy = 0;
    for (npy_intp i = 0; i < u.count; i++)
        busy += u.state[u.pages[i]].use != 0;
    if (busy && !u.judged)
        return PyLong_FromLong(busy);
    for (npy_intp i = 0; i < u.count; i++) {
        Page *page = &u.state[u.pages[i]];
        uint32_t users = 1;
        if (page->use != 0) /* only a page in use has holds */
            for (int k = 0; k < HOLD_KINDS; k++)
                users += page->holds[k];
        page->use = users;
        page->gen += 1;
        page->owner = (int32_t)u.req;
        page->own = NOBODY;
        page->prior = page->writer;
        if (u.timed)
            page->since = u.ts;
    }
    return PyLong_FromLong(busy);
}

/* land(pages, state, req, slots, page_size, judged) -> foreign
 * Counts the pages req does not own. If none, or once the ledger has judged them, req's KV
 * lands in every page: writer req, wgen = gen, valid = slots[i] (page_size when slots is
 * None), own req where req owns the page and NOBODY where it does not. Else changes nothing.
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
    long foreign = 0;
    for (npy_intp i = 0; i < count; i++)
        foreign += state[pages[i]].owner != req;
    if (foreign && !judged)
        return PyLong_FromLong(foreign);
    for (npy_intp i = 0; i < count; i++) {
        Page *page = &state[pages[i]];
        page->writer = (int32_t)req;
        page->wgen = page->gen;
        page->valid = slots != NULL ? slots[i] : (uint32_t)page_size;
        page->own = page->owner == req ? (int32_t)req : NOBODY;
    }
    return PyLong_FromLong(foreign);
}

/* end_grant(pages, state, req, ts, judged) -> not_owned
 * Counts the pages req does not own. If none, or once the ledger has judged them, req's
 * grant of each page it owns ends: owner ~req, own NOBODY, use - 1, since = ts (unless ts is
 * None); the others are left as they are. Else changes nothing. Returns the count. */
static PyObject *
end_grant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Update u;
    if (update_args(args, nargs, "end_grant", &u) < 0)
        return NULL;
    long other = 0;
    for (npy_intp i = 0; i < u.count; i++)
        other += u.state[u.pages[i]].owner != u.req;
    if (other && !u.judged)
        return PyLong_FromLong(other);
    for (npy_intp i = 0; i < u.count; i++) {
        Page *page = &u.state[u.pages[i]];
        if (page->owner != u.req)
            continue;
        page->owner = (int32_t)~u.req;
        page->own = NOBODY;
        page->use -= 1;
        if (u.timed)
            page->since = u.ts;
    }
    return PyLong_FromLong(other);
}

/* read_clean(pages, state, req, tokens, page_size) -> bool
 * Whether a context of `tokens` tokens through `pages` (exactly the pages it covers) reads
 * only req's own KV written under its current grant: every page's own tag is req and every
 * page is full, but the last, which holds at least the slots read of it. Changes nothing. */
static PyObject *
read_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_args(nargs, 5, "read_clean") < 0)
        return NULL;
    npy_intp n, count;
    const Page *state = pool_data(args[1], &n);
    if (state == NULL)
        return NULL;
    long req = PyLong_AsLong(args[2]);
    long long tokens = PyLong_AsLongLong(args[3]);
    long long page_size = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    const npy_intp *pages = page_data(args[0], state, n, &count);
    if (pages == NULL)
        return NULL;
    for (npy_intp i = 0; i < count; i++) {
        const Page *page = &state[pages[i]];
        if (page->own != req)
            Py_RETURN_FALSE;
        if ((long long)page->valid < page_size &&
            (i != count - 1 || (long long)page->valid < tokens - (long long)(count - 1) * page_size))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
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
    Reader r = {(const uint8_t *)PyBytes_AS_STRING(args[0]), 0, PyBytes_GET_SIZE(args[0])};
    uint64_t number, seq = 0, ts = 0, pool = 0, tokens = 0;
    int wire, got, seen = 0, kind = 0;
    Py_ssize_t node_start = 0, node_end = 0, start = 0, end = 0, req_start = 0, req_end = 0;
    while ((got = next_field(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 2 && !(seen & 1)) {
            if (span(&r, &node_start, &node_end) < 0)
                Py_RETURN_NONE;
            seen |= 1;
        } else if (number == 2 && wire == 0 && !(seen & 2)) {
            if (varint(r.data, r.end, &r.pos, &seq) < 0)
                Py_RETURN_NONE;
            seen |= 2;
        } else if (number == 3 && wire == 0 && !(seen & 4)) {
            if (varint(r.data, r.end, &r.pos, &ts) < 0)
                Py_RETURN_NONE;
            seen |= 4;
        } else if ((number == EV_ALLOC || number == EV_WRITE || number == EV_FREE || number == EV_READ) &&
                   wire == 2 && !kind) {
            if (span(&r, &start, &end) < 0)
                Py_RETURN_NONE;
            kind = (int)number;
        } else if (number <= 3 || (number >= 10 && number <= 28)) {
            Py_RETURN_NONE; /* a field twice, a wire type not its own, another payload */
        } else if (skip_value(&r, wire) < 0) {
            Py_RETURN_NONE;
        }
    }
    if (got < 0 || !kind)
        Py_RETURN_NONE;
    if (kind == EV_READ) { /* Read: exactly one entry (field 1) */
        Reader entries = {r.data, start, end};
        int n = 0;
        while ((got = next_field(&entries, &number, &wire)) > 0) {
            if (number == 1 && wire == 2) {
                if (n++ || span(&entries, &start, &end) < 0)
                    Py_RETURN_NONE;
            } else if (number == 1 || skip_value(&entries, wire) < 0) {
                Py_RETURN_NONE;
            }
        }
        if (got < 0 || n != 1)
            Py_RETURN_NONE;
    }
    Reader fields = {r.data, start, end};
    if (payload(fields, kind, &req_start, &req_end, &pool, &tokens) < 0)
        Py_RETURN_NONE;
    const char *base = (const char *)r.data;
    PyObject *node;
    Py_ssize_t node_len = node_end - node_start;
    if (last_node != NULL && PyUnicode_GET_LENGTH(last_node) == node_len && PyUnicode_IS_ASCII(last_node) &&
        memcmp(PyUnicode_DATA(last_node), base + node_start, (size_t)node_len) == 0) {
        node = Py_NewRef(last_node);
    } else {
        node = PyUnicode_DecodeUTF8(base + node_start, node_len, NULL);
        if (node == NULL) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        Py_XSETREF(last_node, Py_NewRef(node));
    }
    PyObject *req = PyUnicode_DecodeUTF8(base + req_start, req_end - req_start, NULL);
    if (req == NULL) {
        PyErr_Clear();
        Py_DECREF(node);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iNKLNKKnn)", kind, node, (unsigned long long)seq, (long long)(int64_t)ts, req,
                         (unsigned long long)pool, (unsigned long long)tokens, start, end);
}

static PyMethodDef methods[] = {
    {"page_list", (PyCFunction)(void (*)(void))page_list, METH_FASTCALL, "An event's page list, checked."},
    {"grant", (PyCFunction)(void (*)(void))grant, METH_FASTCALL, "Pages granted to a request."},
    {"land", (PyCFunction)(void (*)(void))land, METH_FASTCALL, "A request's KV lands in pages."},
    {"end_grant", (PyCFunction)(void (*)(void))end_grant, METH_FASTCALL, "A request's grant ends."},
    {"read_clean", (PyCFunction)(void (*)(void))read_clean, METH_FASTCALL, "The clean read check."},
    {"mark_named", (PyCFunction)(void (*)(void))mark_named, METH_FASTCALL, "Requests the page tags name."},
    {"event_head", (PyCFunction)(void (*)(void))event_head, METH_FASTCALL, "A common event read from its bytes."},
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
