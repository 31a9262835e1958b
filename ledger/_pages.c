/* kvguard.ledger._pages: the ledger's loops over pages in C, each one pass over an event's
 * pages instead of several NumPy calls (each costs more in dispatch than a loop over 64
 * pages), and runs of clean events applied whole.
 *
 * - page_list: an event's page list read from its bytes and checked (bounds, repeats);
 * - grant, land, end_grant, read_clean, read_victims, mark_named: the page updates and checks
 *   (pages.py, PoolPages, is their one caller);
 * - apply_clean: a run of a node's events, for as long as each is the clean common case,
 *   applied as the ledger's Python handlers would apply it (runs.c; Ledger.apply_clean).
 *
 * Invariants: every page is checked against the pool's bounds before anything changes. An
 * update first counts the pages that make the event more than the clean case (pages still in
 * use, not owned by the request); when there are some it changes nothing unless the caller
 * says it has judged them (findings are made in Python, from the state as it was), then
 * applies the one update, the same for clean and judged events. Everything here works on
 * arrays and containers handed to it as arguments (PAGE records of a pool, REQ records of the
 * requests, dicts of counts and grants): it reads no Python object's attributes.
 */
#define KVG_PAGES_MAIN /* this file imports NumPy's C API for the module */
#include "pages.h"
#include "wire.h"

PyArray_Descr *kvg_page_descr, *kvg_req_descr, *kvg_handle_descr, *kvg_run_descr;

/* The records of an array of `descr`: writable, C-contiguous, 1-d; else NULL with TypeError. */
void *
kvg_records(PyObject *o, PyArray_Descr *descr, npy_intp *n, const char *what, const char *type)
{
    if (!PyArray_Check(o) || !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)o), descr) ||
        PyArray_NDIM((PyArrayObject *)o) != 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        !PyArray_ISWRITEABLE((PyArrayObject *)o)) {
        PyErr_Format(PyExc_TypeError, "%s: a writable contiguous 1-d array of %s records expected", what, type);
        return NULL;
    }
    *n = PyArray_DIM((PyArrayObject *)o, 0);
    return PyArray_DATA((PyArrayObject *)o);
}

static Page *
pool_data(PyObject *o, npy_intp *n)
{
    return kvg_records(o, kvg_page_descr, n, "state", "PAGE");
}

/* An intp page array, in range [0, n): its data and length, each page's record prefetched
 * (the misses overlap instead of being taken one after another); else NULL with an exception. */
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

/* ---------------------------------------------------------------- page lists */

/* The pages of varint field `field` in data[0, len) as a new intp array, each in [0, n);
 * with `state` (the pool's records, n of them) each page's record prefetched, and with
 * `distinct` also checked not to be listed twice (the `seen` bytes, zero before and after).
 * NULL with IndexError(page), ValueError(page) or TypeError (not a message). */
PyObject *
kvg_decode_pages(const uint8_t *data, Py_ssize_t len, uint64_t field, npy_intp n, Page *state, int distinct)
{
    Py_ssize_t count = wire_scan(data, len, field, NULL);
    if (count < 0) {
        PyErr_SetString(PyExc_TypeError, "page_list: the bytes are not a serialized protobuf message");
        return NULL;
    }
    npy_intp dims[1] = {count};
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INTP);
    if (out == NULL)
        return NULL;
    npy_intp *pages = PyArray_DATA(out);
    _Static_assert(sizeof(npy_intp) == sizeof(int64_t), "intp is 64-bit");
    wire_scan(data, len, field, (int64_t *)pages);
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

/* page_list(message, field, num_pages, state[, start, end]) -> intp array
 * The page list of an event's payload, read from the payload serialized (`field`: the number
 * of its `repeated uint32 pages`), or from bytes [start, end) of `message`: protobuf's own
 * iteration makes a Python int of every page. IndexError(page) for a page outside [0,
 * num_pages); with `state` (the pool's records, of num_pages), ValueError(page) for a page
 * listed twice. */
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
        npy_intp count;
        if (!(state = pool_data(args[3], &count)))
            return NULL;
        if (count != n)
            return PyErr_Format(PyExc_TypeError, "state: %zd records for a pool of %zd pages", (Py_ssize_t)count,
                                (Py_ssize_t)n);
    }
    return kvg_decode_pages(data, len, field, n, state, state != NULL);
}

/* ---------------------------------------------------------------- page updates */

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
 * Counts the pages still in use or reserved. If none, or once the ledger has judged them
 * (judged true), grants every page to req (grant_pages; since = ts unless ts is None). Else
 * changes nothing. Returns the count. */
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

/* ---------------------------------------------------------------- reads */

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
 * pool. Page i is read in full but the last, of which tokens - (count - 1) * page_size slots
 * are. A page the reader owns is stale unless its own tag is the reader's and it holds the
 * slots read; its victim is the prior writer where the reader wrote fewer slots than it read,
 * else the writer. A page it does not own is foreign; its victim is the writer, or the owner
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
 * over the records (the scan before requests are forgotten). IndexError for a tag beyond
 * named (a corrupt state). */
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

static PyMethodDef methods[] = {
    {"page_list", (PyCFunction)(void (*)(void))page_list, METH_FASTCALL, "An event's page list, checked."},
    {"grant", (PyCFunction)(void (*)(void))grant, METH_FASTCALL, "Pages granted to a request."},
    {"land", (PyCFunction)(void (*)(void))land, METH_FASTCALL, "A request's KV lands in pages."},
    {"end_grant", (PyCFunction)(void (*)(void))end_grant, METH_FASTCALL, "A request's grant ends."},
    {"read_clean", (PyCFunction)(void (*)(void))read_clean, METH_FASTCALL, "The clean read check."},
    {"read_victims", (PyCFunction)(void (*)(void))read_victims, METH_FASTCALL, "A refused read judged."},
    {"mark_named", (PyCFunction)(void (*)(void))mark_named, METH_FASTCALL, "Requests the page tags name."},
    {"apply_clean", (PyCFunction)(void (*)(void))kvg_apply_clean, METH_FASTCALL, "A run of clean events applied."},
    {"check_tags", (PyCFunction)(void (*)(void))kvg_check_tags, METH_FASTCALL, "The check before attention."},
    {"batch_clean", (PyCFunction)(void (*)(void))kvg_batch_clean, METH_FASTCALL, "A decode batch's whole check."},
    {"batch_clean_from", (PyCFunction)(void (*)(void))kvg_batch_clean_from, METH_FASTCALL,
     "A decode batch's check, past what was verified before."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.ledger._pages",
    .m_doc = "The ledger's loops over pages.",
    .m_size = -1,
    .m_methods = methods,
};

/* A dtype from a spec dict; NULL with an exception. */
static PyArray_Descr *
dtype(PyObject *spec)
{
    PyArray_Descr *descr = NULL;
    if (spec == NULL || !PyArray_DescrConverter(spec, &descr))
        descr = NULL;
    Py_XDECREF(spec);
    return descr;
}

PyMODINIT_FUNC
PyInit__pages(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* PAGE and REQ from the structs themselves: the Python side can never disagree with the layout. */
#define OFFSET(field) ((Py_ssize_t)offsetof(Page, field))
#define STR(x) #x
#define HOLDS_FORMAT(n) "(" STR(n) ",)<u4"
    kvg_page_descr = dtype(Py_BuildValue(
        "{s:[ssssssssssss],s:[ssssssssssss],s:[nnnnnnnnnnnn],s:n}", "names", "owner", "own", "use", "gen",
        "writer", "wgen", "valid", "prior", "since", "holds", "seen", "reserved", "formats", "<i4", "<i4", "<u4",
        "<u4", "<i4", "<u4", "<u4", "<i4", "<i8", HOLDS_FORMAT(HOLD_KINDS), "u1", "u1", "offsets", OFFSET(owner),
        OFFSET(own), OFFSET(use), OFFSET(gen), OFFSET(writer), OFFSET(wgen), OFFSET(valid), OFFSET(prior),
        OFFSET(since), OFFSET(holds), OFFSET(seen), OFFSET(reserved), "itemsize", (Py_ssize_t)sizeof(Page)));
#undef HOLDS_FORMAT
#undef STR
#undef OFFSET
#define OFFSET(field) ((Py_ssize_t)offsetof(Req, field))
    kvg_req_descr = dtype(Py_BuildValue(
        "{s:[sssssssssssssssssss],s:[sssssssssssssssssss],s:[nnnnnnnnnnnnnnnnnnn],s:n}", "names", "last", "queued",
        "state", "flags", "prompt_tokens", "output_tokens", "bootstrap_tokens", "reserved_pages", "granted_pages",
        "written_pages", "freed_pages", "shared_pages", "sent_pages", "sent_tokens", "sent_bytes", "received_pages",
        "received_tokens", "received_bytes", "reads", "formats", "<i8", "<i8", "u1", "u1", "<u8", "<u8", "<u8", "<u8",
        "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "<u8", "offsets", OFFSET(last),
        OFFSET(queued), OFFSET(state), OFFSET(flags), OFFSET(prompt_tokens), OFFSET(output_tokens),
        OFFSET(bootstrap_tokens), OFFSET(reserved_pages), OFFSET(granted_pages), OFFSET(written_pages),
        OFFSET(freed_pages), OFFSET(shared_pages), OFFSET(sent_pages), OFFSET(sent_tokens), OFFSET(sent_bytes),
        OFFSET(received_pages), OFFSET(received_tokens), OFFSET(received_bytes), OFFSET(reads), "itemsize",
        (Py_ssize_t)sizeof(Req)));
#undef OFFSET
#define OFFSET(field) ((Py_ssize_t)offsetof(Handle, field))
    kvg_handle_descr = dtype(Py_BuildValue("{s:[ss],s:[ss],s:[nn],s:n}", "names", "bound", "req", "formats", "<u4",
                                           "<i4", "offsets", OFFSET(bound), OFFSET(req), "itemsize",
                                           (Py_ssize_t)sizeof(Handle)));
#undef OFFSET
#define OFFSET(field) ((Py_ssize_t)offsetof(RunCounts, field))
    kvg_run_descr = dtype(Py_BuildValue(
        "{s:[ssssssssssss],s:[ssssssssssss],s:[nnnnnnnnnnnn],s:n}", "names", "last_seq", "epoch", "applied",
        "next_sweep", "grant_runs", "wire", "at", "last_ts", "transitions", "missing", "last_missing", "kinds",
        "formats", "<u8", "<u8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "<i8", "(5,)<i8", "offsets",
        OFFSET(last_seq), OFFSET(epoch), OFFSET(applied), OFFSET(next_sweep), OFFSET(grant_runs), OFFSET(wire),
        OFFSET(at), OFFSET(last_ts), OFFSET(transitions), OFFSET(missing), OFFSET(last_missing), OFFSET(kinds),
        "itemsize", (Py_ssize_t)sizeof(RunCounts)));
#undef OFFSET
    if (PyModule_AddIntConstant(m, "REQ_BYTES", REQ_BYTES) < 0 || kvg_page_descr == NULL || kvg_req_descr == NULL ||
        kvg_handle_descr == NULL || kvg_run_descr == NULL ||
        PyModule_AddIntConstant(m, "HANDLE_SLOT_MASK", HANDLE_SLOT_MASK) < 0 ||
        PyModule_AddObjectRef(m, "PAGE", (PyObject *)kvg_page_descr) < 0 ||
        PyModule_AddObjectRef(m, "REQ", (PyObject *)kvg_req_descr) < 0 ||
        PyModule_AddObjectRef(m, "HANDLE", (PyObject *)kvg_handle_descr) < 0 ||
        PyModule_AddObjectRef(m, "RUN", (PyObject *)kvg_run_descr) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
