/* Runs of a node's clean events applied whole (kvguard.ledger._pages.apply_clean): the
 * events every request makes, for as long as each is the clean common case, applied from their
 * heads (proto/wire.h) as the ledger's Python handlers would apply them, in the same order,
 * so that the state after either is the same to the byte (tests/ledger/test_pages.py and
 * test_property.py compare them). Everything is handed in as arguments: the node's pools, the
 * request index and table; it reads no Python object's attributes.
 */
#include "pages.h"
#include "wire.h"

/* A pool of the run's node as handed in: (state, page_size, timed, live, grants). */
typedef struct {
    uint32_t id;
    int found;       /* 1: the node has this pool */
    PyObject *array; /* the PAGE records, kept alive while used */
    PyObject *live;  /* request index -> pages granted to it now */
    PyObject *grants; /* request index -> list of arrays: every page ever granted */
    Page *state;
    npy_intp num_pages;
    long long page_size;
    int timed; /* the pool reported its memory: grants and frees record `since` */
} PoolAt;

/* What apply_clean works with, and the counts of what it applied (returned at the end). */
typedef struct {
    const uint8_t *data;
    const WireHead *heads;
    const char *name;
    Py_ssize_t name_len, grant_runs;
    PyObject *pools, *req_index, *joined, *make, *table;
    Req *reqs;
    npy_intp n_reqs;
    int wire; /* a transfer waits for a probe's verdict: frees and reads are Python's */
    PoolAt pool;
    uint64_t last_seq, epoch;
    int64_t last_ts;
    long long applied, next_sweep, transitions, missing, last_missing;
    long long kinds[5]; /* alloc, write, free, read, step */
} Run;

static void
pool_release(PoolAt *p)
{
    Py_CLEAR(p->array);
    Py_CLEAR(p->live);
    Py_CLEAR(p->grants);
    p->found = 0;
}

/* The run's pool becomes pool `id` of the node: 1, 0 if the node has no such pool, -1 with
 * an exception. */
static int
pool_at(Run *c, uint32_t id)
{
    PoolAt *p = &c->pool;
    if (p->found && p->id == id)
        return 1;
    pool_release(p);
    PyObject *key = PyLong_FromUnsignedLong(id);
    if (key == NULL)
        return -1;
    PyObject *view = PyDict_GetItemWithError(c->pools, key); /* borrowed */
    Py_DECREF(key);
    if (view == NULL)
        return PyErr_Occurred() ? -1 : 0;
    npy_intp n;
    if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 5 ||
        !(p->state = kvg_records(PyTuple_GET_ITEM(view, 0), kvg_page_descr, &n, "state", "PAGE"))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "apply_clean: a pool is (state, page_size, timed, live, grants)");
        return -1;
    }
    p->page_size = PyLong_AsLongLong(PyTuple_GET_ITEM(view, 1));
    p->timed = PyObject_IsTrue(PyTuple_GET_ITEM(view, 2));
    if (PyErr_Occurred() || p->timed < 0)
        return -1;
    if (p->page_size <= 0 || !PyDict_Check(PyTuple_GET_ITEM(view, 3)) || !PyDict_Check(PyTuple_GET_ITEM(view, 4))) {
        PyErr_SetString(PyExc_TypeError, "apply_clean: a pool's page size, live counts or grants are not sound");
        return -1;
    }
    p->num_pages = n;
    p->id = id;
    p->found = 1;
    p->array = Py_NewRef(PyTuple_GET_ITEM(view, 0));
    p->live = Py_NewRef(PyTuple_GET_ITEM(view, 3));
    p->grants = Py_NewRef(PyTuple_GET_ITEM(view, 4));
    return 1;
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

/* A request's grants kept as one int32 array once there are more than grant_runs of them
 * (ownership.py's alloc does the same): decode grants a page at a time. */
static int
merge(PoolAt *p, PyObject *idx, PyObject *grants)
{
    PyObject *all = PyArray_Concatenate(grants, 0);
    if (all == NULL)
        return -1;
    PyObject *small = PyArray_Cast((PyArrayObject *)all, NPY_INT32);
    Py_DECREF(all);
    PyObject *one = small == NULL ? NULL : PyList_New(1);
    if (one == NULL) {
        Py_XDECREF(small);
        return -1;
    }
    PyList_SET_ITEM(one, 0, small);
    int rc = PyDict_SetItem(p->grants, idx, one);
    Py_DECREF(one);
    return rc;
}

/* make(name, applied) -> the request table, which the new request's row may have moved. */
static int
make_request(Run *c, PyObject *req)
{
    PyObject *table = PyObject_CallFunction(c->make, "OL", req, c->applied);
    if (table == NULL)
        return -1;
    Py_XSETREF(c->table, table); /* kept alive while its records are written */
    Req *reqs = kvg_records(table, kvg_req_descr, &c->n_reqs, "make()", "REQ");
    if (reqs == NULL)
        return -1;
    c->reqs = reqs;
    return 0;
}

static int
kind_index(int kind)
{
    return kind == WIRE_ALLOC ? 0 : kind == WIRE_WRITE ? 1 : kind == WIRE_FREE ? 2 : kind == WIRE_READ ? 3 : 4;
}

/* The run's counts after applying the event of head h. */
static void
ran(Run *c, const WireHead *h)
{
    c->kinds[kind_index(h->kind)]++;
    c->last_missing = (long long)(h->seq - c->last_seq - 1);
    c->missing += c->last_missing;
    c->last_seq = h->seq;
    c->last_ts = h->ts;
    c->applied += 1;
}

/* The values of a packed field's bytes [start, end) into out (room for `room`): how many, or
 * -1 when there are more, or one is beyond uint32, or the bytes end inside one. */
static Py_ssize_t
packed_u32(const uint8_t *data, Py_ssize_t start, Py_ssize_t end, uint32_t *out, Py_ssize_t room)
{
    Py_ssize_t n = 0, pos = start;
    uint64_t value;
    while (pos < end) {
        if (n == room || wire_varint(data, end, &pos, &value) < 0 || value > UINT32_MAX)
            return -1;
        out[n++] = (uint32_t)value;
    }
    return n;
}

/* The counts of the step's packed field at [start, end) (0 when absent: end == start). */
static Py_ssize_t
packed_count(const uint8_t *data, Py_ssize_t start, Py_ssize_t end)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t pos = start; pos < end; pos++)
        n += !(data[pos] & 0x80);
    return n;
}

/* A step of the run's node, whose envelope clean_event checked: 1 if every request's write
 * is the clean case and all are applied, in order, as the handlers apply them; 0 if any is
 * not (nothing changed: the handlers judge it), -1 with an exception. Clean: the shape is
 * sound (as many counts as requests, adding up to the pages, slots none or one per page and
 * at most the page size, pages in range and distinct within each request's part), and each
 * request is known, in use, not ended, and owns every page of its part. */
static int
clean_step(Run *c, const WireHead *h)
{
    int found = pool_at(c, h->pool);
    if (found <= 0)
        return found;
    PoolAt *p = &c->pool;
    Py_ssize_t span[3][2] = {{0, 0}, {0, 0}, {0, 0}}, n_reqs = 0, a, b;
    WireReader r = {c->data, h->pay_start, h->pay_end};
    uint64_t number;
    int wire;
    while (wire_next(&r, &number, &wire) > 0) { /* wire_step checked the shape */
        if (wire != 2 || number < 2 || number > 5) {
            if (wire_skip(&r, wire) < 0)
                return 0;
        } else if (wire_span(&r, &a, &b, 0) < 0) {
            return 0;
        } else if (number == 2) {
            n_reqs++;
        } else {
            span[number - 3][0] = a;
            span[number - 3][1] = b;
        }
    }
    Py_ssize_t n_counts = packed_count(c->data, span[0][0], span[0][1]);
    Py_ssize_t n_pages = packed_count(c->data, span[1][0], span[1][1]);
    Py_ssize_t n_slots = packed_count(c->data, span[2][0], span[2][1]);
    if (n_counts != n_reqs || (n_slots && n_slots != n_pages))
        return 0;
    /* One block: the parts' bounds and request indices, the pages, the slots. */
    size_t bytes = (size_t)n_reqs * (sizeof(Py_ssize_t) + sizeof(uint32_t)) +
                   (size_t)n_pages * (sizeof(npy_intp) + 2 * sizeof(uint32_t)) + 1;
    char *block = PyMem_Malloc(bytes);
    if (block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t *idx = (Py_ssize_t *)block;
    npy_intp *pages = (npy_intp *)(idx + n_reqs);
    uint32_t *counts = (uint32_t *)(pages + n_pages), *raw = counts + n_reqs, *slots = raw + n_pages;
    int rc = 0;
    Py_ssize_t marked, total = 0;
    if (packed_u32(c->data, span[0][0], span[0][1], counts, n_reqs) != n_reqs ||
        packed_u32(c->data, span[1][0], span[1][1], raw, n_pages) != n_pages ||
        (n_slots && packed_u32(c->data, span[2][0], span[2][1], slots, n_pages) != n_pages))
        goto out;
    for (Py_ssize_t i = 0; i < n_reqs; i++)
        total += counts[i];
    if (total != n_pages)
        goto out;
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        if (raw[i] >= (uint64_t)p->num_pages || (n_slots && slots[i] > (uint64_t)p->page_size))
            goto out;
        pages[i] = raw[i];
        PREFETCH(&p->state[raw[i]]); /* the misses overlap, not one after another */
    }
    /* The requests: known, in use, not ended, owning their parts' pages, each listed once. */
    r = (WireReader){c->data, h->pay_start, h->pay_end};
    Py_ssize_t k = 0, at = 0;
    while (wire_next(&r, &number, &wire) > 0) {
        if (number != 2) {
            if (wire_skip(&r, wire) < 0)
                goto out;
            continue;
        }
        if (wire_span(&r, &a, &b, 0) < 0 || a == b)
            goto out;
        PyObject *name = PyUnicode_DecodeUTF8((const char *)c->data + a, b - a, NULL);
        if (name == NULL) {
            PyErr_Clear();
            goto out;
        }
        PyObject *found_idx = PyDict_GetItemWithError(c->req_index, name); /* borrowed */
        Py_DECREF(name);
        if (found_idx == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        Py_ssize_t x = PyLong_AsSsize_t(found_idx);
        if (x == -1 && PyErr_Occurred()) {
            rc = -1;
            goto out;
        }
        if (x <= NOBODY || x >= c->n_reqs || (c->reqs[x].flags & RETIRED) || c->reqs[x].state >= ENDED)
            goto out;
        const npy_intp *part = pages + at;
        int twice = 0;
        for (marked = 0; marked < (Py_ssize_t)counts[k] && !twice; marked++) { /* distinct within the part */
            twice = p->state[part[marked]].seen;
            p->state[part[marked]].seen = 1;
        }
        for (Py_ssize_t j = 0; j < marked; j++) /* the scratch is zero again between calls */
            p->state[part[j]].seen = 0;
        if (twice || not_owned(p->state, part, counts[k], (long)x))
            goto out;
        idx[k++] = x;
        at += counts[k - 1];
    }
    /* Clean: applied from here on. */
    at = 0;
    for (k = 0; k < n_reqs; at += counts[k], k++) {
        Req *req = &c->reqs[idx[k]];
        req->last = c->applied;
        land_pages(p->state, pages + at, counts[k], (long)idx[k], n_slots ? slots + at : NULL, (uint32_t)p->page_size);
        req->written_pages += counts[k];
    }
    c->transitions += n_pages;
    rc = 1;
out:
    PyMem_Free(block);
    return rc;
}

/* Head i of the run: 1 if it was the clean common case and is applied, 0 if it is not
 * (nothing changed: it is for the Python handlers), -1 with an exception. Clean: an alloc,
 * a write (with slots, each at most the page size, or whole pages), a free, a one-entry read
 * or a step (clean_step) of the run's node and epoch, next in its sequence (a gap opens, or is
 * filled, in the ledger's handlers: sequence.py), of a pool it
 * reported, its pages valid (and distinct, but a read's), of a request the ledger knows (an
 * alloc of one it does not know is its first event: `make` makes it and the run goes on), in
 * use (not retired) and not ended (a free may come after the end), whose pages need no
 * judgment (grant_busy, not_owned, read_is_clean); an alloc of a request not waiting for the
 * transfer it was bootstrapped for (before receipt a grant is a reservation, which the
 * handlers count). Applied as the handlers apply it, in the same order (a request's grants
 * merged as they merge them); the run ends after an event that makes a sweep due (the ledger
 * sweeps, then goes on). */
static int
clean_event(Run *c, Py_ssize_t i)
{
    const WireHead *h = &c->heads[i];
    if (!h->plain || h->node_end - h->node_start != c->name_len ||
        memcmp(c->data + h->node_start, c->name, (size_t)c->name_len) != 0 || h->seq != c->last_seq + 1 || h->seq > (uint64_t)INT64_MAX ||
        ((h->kind == WIRE_FREE || h->kind == WIRE_READ) && c->wire) || h->epoch != c->epoch)
        return 0;
    if (h->kind == WIRE_STEP) {
        int rc = clean_step(c, h);
        if (rc == 1)
            ran(c, h);
        return rc;
    }
    if (h->req_end == h->req_start)
        return 0;
    int found = pool_at(c, h->pool);
    if (found <= 0)
        return found;
    PoolAt *p = &c->pool;
    PyObject *array = kvg_decode_pages(c->data + h->pay_start, (Py_ssize_t)(h->pay_end - h->pay_start), WIRE_PAGES,
                                   p->num_pages, p->state, h->kind != WIRE_READ); /* a block table may repeat a page */
    if (array == NULL) {
        PyErr_Clear(); /* out of range, listed twice, malformed: the handlers word the error */
        return 0;
    }
    const npy_intp *pages = PyArray_DATA((PyArrayObject *)array);
    npy_intp count = PyArray_DIM((PyArrayObject *)array, 0);
    int rc = 0;
    PyObject *req = NULL, *grants = NULL;
    int64_t *raw = NULL; /* a write's slots as read, then as uint32 in place (`slots`) */
    uint32_t *slots = NULL;
    if (h->kind == WIRE_READ) { /* the pages the context covers (a block table may be longer) */
        uint64_t need = h->tokens / (uint64_t)p->page_size + (h->tokens % (uint64_t)p->page_size != 0);
        if (need > (uint64_t)count)
            goto out;
        count = (npy_intp)need;
    }
    if (h->req_end - h->req_start > REQ_BYTES || /* the store could not keep it: the handlers refuse it */
        memchr(c->data + h->req_start, 0, h->req_end - h->req_start) != NULL)
        goto out;
    req = PyUnicode_DecodeUTF8((const char *)c->data + h->req_start, h->req_end - h->req_start, NULL);
    if (req == NULL) {
        PyErr_Clear();
        goto out;
    }
    PyObject *idx = PyDict_GetItemWithError(c->req_index, req); /* borrowed */
    if (idx == NULL && !PyErr_Occurred() && h->kind == WIRE_ALLOC) {
        /* A request's first event is its first grant: the ledger makes it (its table may move),
         * then the alloc is judged here as any other. A call, not a return to the ledger and a
         * new run: a new request comes every few events of a batch. */
        if (make_request(c, req) < 0) {
            rc = -1;
            goto out;
        }
        idx = PyDict_GetItemWithError(c->req_index, req);
    }
    if (idx == NULL) {
        if (PyErr_Occurred())
            rc = -1;
        goto out;
    }
    Py_ssize_t at = PyLong_AsSsize_t(idx);
    if (at == -1 && PyErr_Occurred()) {
        rc = -1;
        goto out;
    }
    if (at <= NOBODY || at >= c->n_reqs)
        goto out;
    Req *r = &c->reqs[at];
    if ((r->flags & RETIRED) || (h->kind != WIRE_FREE && r->state >= ENDED))
        goto out;
    switch (h->kind) {
    case WIRE_ALLOC:
        if ((r->flags & BOOTSTRAPPED) && r->received_tokens == 0) /* a decode reservation: counted */
            goto out;
        grants = PyDict_GetItemWithError(p->grants, idx);
        if (grants == NULL && PyErr_Occurred()) {
            rc = -1;
            goto out;
        }
        Py_XINCREF(grants);
        if ((grants != NULL && !PyList_Check(grants)) || grant_busy(p->state, pages, count))
            goto out;
        break;
    case WIRE_WRITE:
        if (h->plain == 2) { /* its slots: one a page, none beyond the page size */
            const uint8_t *pay = c->data + h->pay_start;
            Py_ssize_t len = (Py_ssize_t)(h->pay_end - h->pay_start);
            if (wire_scan(pay, len, 4, NULL) != count)
                goto out;
            raw = PyMem_Malloc(sizeof(int64_t) * (size_t)(count + 1));
            if (raw == NULL) {
                PyErr_NoMemory();
                rc = -1;
                goto out;
            }
            wire_scan(pay, len, 4, raw);
            slots = (uint32_t *)raw; /* in place: each slot is read before its place is written */
            for (npy_intp j = 0; j < count; j++) {
                if (raw[j] > p->page_size)
                    goto out;
                slots[j] = (uint32_t)raw[j];
            }
        }
        if (not_owned(p->state, pages, count, (long)at))
            goto out;
        break;
    case WIRE_FREE:
        if (not_owned(p->state, pages, count, (long)at))
            goto out;
        if (count && PyDict_GetItemWithError(p->live, idx) == NULL) { /* the handlers' to word */
            rc = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        break;
    default:
        if (!read_is_clean(p->state, pages, count, (long)at, (long long)h->tokens, p->page_size))
            goto out;
    }
    /* Clean: applied from here on. */
    rc = -1;
    r->last = c->applied;
    switch (h->kind) {
    case WIRE_ALLOC:
        grant_pages(p->state, pages, count, (long)at, h->ts, p->timed);
        if (grants != NULL) {
            if (PyList_Append(grants, array) < 0 ||
                (PyList_GET_SIZE(grants) > c->grant_runs && merge(p, idx, grants) < 0))
                goto out;
        } else {
            PyObject *one = PyList_New(1);
            if (one == NULL)
                goto out;
            PyList_SET_ITEM(one, 0, Py_NewRef(array));
            int set = PyDict_SetItem(p->grants, idx, one);
            Py_DECREF(one);
            PyObject *pair = set < 0 ? NULL : Py_BuildValue("(OI)", idx, p->id);
            set = pair == NULL ? -1 : PyList_Append(c->joined, pair); /* the request's pools: the ledger notes this one */
            Py_XDECREF(pair);
            if (set < 0)
                goto out;
        }
        if (add_item(p->live, idx, count) < 0)
            goto out;
        r->granted_pages += (uint64_t)count;
        break;
    case WIRE_WRITE:
        land_pages(p->state, pages, count, (long)at, h->plain == 2 ? slots : NULL, (uint32_t)p->page_size);
        r->written_pages += (uint64_t)count;
        break;
    case WIRE_FREE:
        end_pages(p->state, pages, count, (long)at, h->ts, p->timed);
        if (count && add_item(p->live, idx, -(long long)count) < 0)
            goto out;
        r->freed_pages += (uint64_t)count;
        break;
    default:
        r->reads += 1;
    }
    c->transitions += count;
    ran(c, h);
    rc = 1;
out:
    PyMem_Free(raw);
    Py_DECREF(array);
    Py_XDECREF(req);
    Py_XDECREF(grants);
    return rc;
}

/* apply_clean(data, heads, start, stop, node, last_seq, applied, next_sweep, wire, pools,
 *             req_index, reqs, grant_runs, joined, make, epoch)
 *   -> (at, last_seq, last_ts, applied, transitions, missing, last_missing, kinds, error)
 * Applies the events of heads[start:stop] (HEAD records of `data`: a batch of `node`'s
 * stream; heads None: `data` is one event, [start, stop) is [0, 1)) in order, for as long as each is the clean common case (clean_event), as the
 * ledger's handlers would; returns where it stopped (`at`: stop when it applied them all),
 * and the node's and the
 * ledger's counts after what it applied: the last sequence number and time, the applied
 * events' count, page transitions, missing sequence numbers (all, and before the last), and
 * per kind (alloc, write, free, read, step) how many; only events of the node's `epoch` are
 * applied (a new epoch is the ledger's to begin). `pools`: the node's pools by id, each (state,
 * page_size, timed, live, grants); `req_index`: request name -> index into `reqs` (REQ
 * records); `wire`: frees and reads wait (a probe's verdict is pending); every (request,
 * pool) whose first grants entry it made is appended to `joined`; `make(name, applied)` makes
 * a request (at that count of applied events) and returns the table. `error`: None, or the
 * exception an event raised (a bug), for the caller to raise once it has taken the counts. */
PyObject *
kvg_apply_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 16)
        return PyErr_Format(PyExc_TypeError, "apply_clean() takes 16 arguments (%zd given)", nargs);
    Run c;
    memset(&c, 0, sizeof(c));
    if (!PyBytes_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "apply_clean: bytes expected, got %.80s", Py_TYPE(args[0])->tp_name);
    c.data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]), n_heads = 1;
    PyObject *heads = args[1];
    WireHead one;
    if (heads == Py_None) { /* one event, `data`: its head read here (the guard's path) */
        if (len > (Py_ssize_t)UINT32_MAX)
            return PyErr_Format(PyExc_ValueError, "apply_clean: an event of %zd bytes", len);
        wire_head(c.data, 0, len, &one);
        c.heads = &one;
    } else {
        if (!PyArray_Check(heads) || PyArray_NDIM((PyArrayObject *)heads) != 1 ||
            PyArray_ITEMSIZE((PyArrayObject *)heads) != sizeof(WireHead) ||
            !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)heads))
            return PyErr_Format(PyExc_TypeError, "apply_clean: a contiguous HEAD array expected");
        c.heads = PyArray_DATA((PyArrayObject *)heads);
        n_heads = PyArray_DIM((PyArrayObject *)heads, 0);
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    c.last_seq = PyLong_AsUnsignedLongLong(args[5]);
    c.applied = PyLong_AsLongLong(args[6]);
    c.next_sweep = PyLong_AsLongLong(args[7]);
    c.wire = PyObject_IsTrue(args[8]);
    c.grant_runs = PyLong_AsSsize_t(args[12]);
    c.epoch = PyLong_AsUnsignedLongLong(args[15]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0 || stop > n_heads || start > stop)
        return PyErr_Format(PyExc_IndexError, "apply_clean: [%zd, %zd) outside %zd heads", start, stop, n_heads);
    for (Py_ssize_t i = start; i < stop; i++) /* the heads must lie in the bytes (batch() made them so) */
        if (c.heads[i].end > (uint64_t)len || c.heads[i].pay_end > c.heads[i].end ||
            c.heads[i].node_end > c.heads[i].end || c.heads[i].req_end > c.heads[i].end)
            return PyErr_Format(PyExc_ValueError, "apply_clean: head %zd lies outside the bytes", i);
    if (!(c.name = PyUnicode_AsUTF8AndSize(args[4], &c.name_len)))
        return NULL;
    c.pools = args[9];
    c.req_index = args[10];
    c.joined = args[13];
    c.make = args[14];
    if (!PyDict_Check(c.pools) || !PyDict_Check(c.req_index) || !PyList_Check(c.joined))
        return PyErr_Format(PyExc_TypeError, "apply_clean: pools and req_index are dicts, joined a list");
    if (!(c.reqs = kvg_records(args[11], kvg_req_descr, &c.n_reqs, "reqs", "REQ")))
        return NULL;
    Py_ssize_t i = start;
    int failed = 0;
    for (; i < stop; i++) {
        int applied = clean_event(&c, i);
        if (applied <= 0) {
            failed = applied < 0;
            break;
        }
        if (c.applied == c.next_sweep) { /* a sweep is due: the ledger's, before the next event */
            i++;
            break;
        }
    }
    pool_release(&c.pool);
    Py_CLEAR(c.table);
    /* What was applied is said even when an event failed (a bug, or out of memory), so that
     * the ledger stays whole: the error comes last, for the caller to raise then. */
    PyObject *error = Py_NewRef(Py_None);
    if (failed) {
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyErr_NormalizeException(&type, &value, &trace);
        Py_XDECREF(type);
        Py_XDECREF(trace);
        if (value != NULL)
            Py_SETREF(error, value);
    }
    return Py_BuildValue("(nKLLLLL(LLLLL)N)", i, (unsigned long long)c.last_seq, (long long)c.last_ts,
                         c.applied, c.transitions, c.missing, c.last_missing, c.kinds[0], c.kinds[1], c.kinds[2],
                         c.kinds[3], c.kinds[4], error);
}

