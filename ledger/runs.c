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
    const Handle *handles; /* the node's handles in this epoch, by slot (handles.py) */
    npy_intp n_handles;
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

/* Grants the pages of `array` (intp) to request `at` (`idx`: its index as an int) as the
 * handlers' alloc does (its checks passed: alloc_is_clean): the page records, its grants in
 * the pool (a new one's pool noted in `joined`), its live count and its granted pages; -1 with
 * an exception. */
static int
grant_to(Run *c, PoolAt *p, Py_ssize_t at, PyObject *idx, PyObject *array, int64_t ts)
{
    const npy_intp *pages = PyArray_DATA((PyArrayObject *)array);
    npy_intp count = PyArray_DIM((PyArrayObject *)array, 0);
    PyObject *grants = PyDict_GetItemWithError(p->grants, idx); /* borrowed */
    if (grants == NULL && PyErr_Occurred())
        return -1;
    grant_pages(p->state, pages, count, (long)at, ts, p->timed);
    if (grants != NULL) {
        if (PyList_Append(grants, array) < 0 || (PyList_GET_SIZE(grants) > c->grant_runs && merge(p, idx, grants) < 0))
            return -1;
    } else {
        PyObject *one = PyList_New(1);
        if (one == NULL)
            return -1;
        PyList_SET_ITEM(one, 0, Py_NewRef(array));
        int set = PyDict_SetItem(p->grants, idx, one);
        Py_DECREF(one);
        PyObject *pair = set < 0 ? NULL : Py_BuildValue("(OI)", idx, p->id);
        set = pair == NULL ? -1 : PyList_Append(c->joined, pair); /* the request's pools: the ledger notes this one */
        Py_XDECREF(pair);
        if (set < 0)
            return -1;
    }
    if (add_item(p->live, idx, count) < 0)
        return -1;
    c->reqs[at].granted_pages += (uint64_t)count;
    return 0;
}

/* Whether a grant of `count` pages to request r (`idx`) is the clean case: not a decode
 * reservation (the handlers count those), its grants in the pool a list (or none yet), every
 * page free and not reserved: 1, 0 if not, -1 with an exception. */
static int
alloc_is_clean(PoolAt *p, const Req *r, PyObject *idx, const npy_intp *pages, npy_intp count)
{
    if ((r->flags & BOOTSTRAPPED) && r->received_tokens == 0) /* a decode reservation: counted */
        return 0;
    PyObject *grants = PyDict_GetItemWithError(p->grants, idx); /* borrowed */
    if (grants == NULL && PyErr_Occurred())
        return -1;
    return !((grants != NULL && !PyList_Check(grants)) || grant_busy(p->state, pages, count));
}

/* The index of the request named data[a, b) (0 if unknown: the handlers word it), -1 with an
 * exception. */
static Py_ssize_t
index_of_name(Run *c, Py_ssize_t a, Py_ssize_t b)
{
    PyObject *name = PyUnicode_DecodeUTF8((const char *)c->data + a, b - a, NULL);
    if (name == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *found = PyDict_GetItemWithError(c->req_index, name); /* borrowed */
    Py_DECREF(name);
    if (found == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyLong_AsSsize_t(found);
}

/* A step of the run's node, whose envelope clean_event checked: 1 if every request's grant and
 * write are the clean case and all are applied, in order, as the handlers apply them (the
 * grants first, then the writes); 0 if any is not (nothing changed: the handlers judge it), -1
 * with an exception. Clean: the shape is sound (the requests named by names or by handles, not
 * both; as many counts, and grants if any, as requests; the counts adding up to the pages,
 * slots none or one per page and at most the page size, pages in range and distinct within
 * each request's part, granted pages distinct across the step), and each request is known (a
 * handle bound now), in use, not ended, owns every page of its part but the granted ones, and
 * each grant is the clean case (alloc_is_clean). */
static int
clean_step(Run *c, const WireHead *h)
{
    int found = pool_at(c, h->pool);
    if (found <= 0)
        return found;
    PoolAt *p = &c->pool;
    Py_ssize_t span[5][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}}, n_names = 0, a, b;
    WireReader r = {c->data, h->pay_start, h->pay_end};
    uint64_t number;
    int wire;
    while (wire_next(&r, &number, &wire) > 0) { /* wire_step checked the shape */
        if (wire != 2 || number < 2 || number > 7) {
            if (wire_skip(&r, wire) < 0)
                return 0;
        } else if (wire_span(&r, &a, &b, 0) < 0) {
            return 0;
        } else if (number == 2) {
            n_names++;
        } else {
            span[number - 3][0] = a;
            span[number - 3][1] = b;
        }
    }
    Py_ssize_t n_counts = packed_count(c->data, span[0][0], span[0][1]);
    Py_ssize_t n_pages = packed_count(c->data, span[1][0], span[1][1]);
    Py_ssize_t n_slots = packed_count(c->data, span[2][0], span[2][1]);
    Py_ssize_t n_handles = packed_count(c->data, span[3][0], span[3][1]);
    Py_ssize_t n_grants = packed_count(c->data, span[4][0], span[4][1]);
    Py_ssize_t n_reqs = n_names + n_handles;
    if ((n_names && n_handles) || n_counts != n_reqs || (n_slots && n_slots != n_pages) ||
        (n_grants && n_grants != n_reqs))
        return 0;
    /* One block: the request indices, the pages, the counts, pages as read, slots, handles, grants. */
    size_t bytes = (size_t)n_reqs * (sizeof(Py_ssize_t) + 3 * sizeof(uint32_t)) +
                   (size_t)n_pages * (sizeof(npy_intp) + 2 * sizeof(uint32_t)) + 1;
    char *block = PyMem_Malloc(bytes);
    if (block == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t *idx = (Py_ssize_t *)block;
    npy_intp *pages = (npy_intp *)(idx + n_reqs);
    uint32_t *counts = (uint32_t *)(pages + n_pages), *raw = counts + n_reqs, *slots = raw + n_pages;
    uint32_t *handles = slots + n_pages, *grants = handles + n_reqs;
    int rc = 0;
    Py_ssize_t marked, total = 0, granted = 0;
    if (packed_u32(c->data, span[0][0], span[0][1], counts, n_reqs) != n_reqs ||
        packed_u32(c->data, span[1][0], span[1][1], raw, n_pages) != n_pages ||
        (n_slots && packed_u32(c->data, span[2][0], span[2][1], slots, n_pages) != n_pages) ||
        (n_handles && packed_u32(c->data, span[3][0], span[3][1], handles, n_reqs) != n_reqs) ||
        (n_grants && packed_u32(c->data, span[4][0], span[4][1], grants, n_reqs) != n_reqs))
        goto out;
    if (!n_grants)
        memset(grants, 0, sizeof(uint32_t) * (size_t)n_reqs);
    for (Py_ssize_t i = 0; i < n_reqs; i++) {
        if (grants[i] > counts[i])
            goto out;
        total += counts[i];
        granted += grants[i];
    }
    if (total != n_pages)
        goto out;
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        if (raw[i] >= (uint64_t)p->num_pages || (n_slots && slots[i] > (uint64_t)p->page_size))
            goto out;
        pages[i] = raw[i];
        PREFETCH(&p->state[raw[i]]); /* the misses overlap, not one after another */
    }
    /* The requests, by handle (bound now) or by name (known). */
    if (n_handles) {
        for (Py_ssize_t k = 0; k < n_reqs; k++) {
            uint32_t slot = handles[k] & HANDLE_SLOT_MASK;
            if (slot == 0 || slot >= (uint64_t)c->n_handles || c->handles[slot].bound != handles[k])
                goto out;
            idx[k] = c->handles[slot].req;
        }
    } else {
        r = (WireReader){c->data, h->pay_start, h->pay_end};
        Py_ssize_t k = 0;
        while (wire_next(&r, &number, &wire) > 0) {
            if (number != 2) {
                if (wire_skip(&r, wire) < 0)
                    goto out;
                continue;
            }
            if (wire_span(&r, &a, &b, 0) < 0 || a == b)
                goto out;
            Py_ssize_t x = index_of_name(c, a, b);
            if (x <= 0) {
                rc = x < 0 || PyErr_Occurred() ? -1 : 0;
                goto out;
            }
            idx[k++] = x;
        }
    }
    /* Each request: in use, not ended, owning its part's pages but the granted ones, listing
     * none twice; its grant (if any) the clean case. */
    Py_ssize_t at = 0;
    for (Py_ssize_t k = 0; k < n_reqs; at += counts[k], k++) {
        Py_ssize_t x = idx[k];
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
        if (twice || not_owned(p->state, part, counts[k] - grants[k], (long)x))
            goto out;
        if (grants[k]) {
            PyObject *key = PyLong_FromSsize_t(x);
            int clean = key == NULL ? -1 : alloc_is_clean(p, &c->reqs[x], key, part + counts[k] - grants[k], grants[k]);
            Py_XDECREF(key);
            if (clean <= 0) {
                rc = clean;
                goto out;
            }
        }
    }
    if (granted) { /* no page granted twice in the step (each grant was checked alone) */
        int twice = 0;
        Py_ssize_t k = 0, done = 0;
        for (at = 0; k < n_reqs && !twice; at += counts[k], k++)
            for (Py_ssize_t j = counts[k] - grants[k]; j < (Py_ssize_t)counts[k] && !twice; j++, done++) {
                twice = p->state[pages[at + j]].seen;
                p->state[pages[at + j]].seen = 1;
            }
        for (Py_ssize_t kk = 0, left = done, from = 0; kk < n_reqs && left > 0; from += counts[kk], kk++)
            for (Py_ssize_t j = counts[kk] - grants[kk]; j < (Py_ssize_t)counts[kk] && left > 0; j++, left--)
                p->state[pages[from + j]].seen = 0;
        if (twice)
            goto out;
    }
    /* Clean: applied from here on, the grants first (as the handlers' allocs, in order). */
    rc = -1;
    at = 0;
    for (Py_ssize_t k = 0; k < n_reqs; at += counts[k], k++) {
        if (!grants[k])
            continue;
        npy_intp g = grants[k];
        PyObject *array = PyArray_SimpleNew(1, &g, NPY_INTP);
        PyObject *key = array == NULL ? NULL : PyLong_FromSsize_t(idx[k]);
        if (key != NULL)
            memcpy(PyArray_DATA((PyArrayObject *)array), pages + at + counts[k] - g, sizeof(npy_intp) * (size_t)g);
        int fail = key == NULL || grant_to(c, p, idx[k], key, array, h->ts) < 0;
        Py_XDECREF(key);
        Py_XDECREF(array);
        if (fail)
            goto out;
    }
    at = 0;
    for (Py_ssize_t k = 0; k < n_reqs; at += counts[k], k++) {
        Req *req = &c->reqs[idx[k]];
        req->last = c->applied;
        land_pages(p->state, pages + at, counts[k], (long)idx[k], n_slots ? slots + at : NULL, (uint32_t)p->page_size);
        req->written_pages += counts[k];
    }
    c->transitions += n_pages + granted;
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
    PyObject *req = NULL;
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
    case WIRE_ALLOC: {
        int clean = alloc_is_clean(p, r, idx, pages, count);
        if (clean <= 0) {
            rc = clean;
            goto out;
        }
        break;
    }
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
        if (grant_to(c, p, at, idx, array, h->ts) < 0)
            goto out;
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
    return rc;
}

/* apply_clean(data, heads, start, stop, run, node, requests) -> None or the error
 * Applies the events of heads[start:stop] (HEAD records of `data`: a batch of the node's
 * stream; heads None: `data` is one event, [start, stop) is [0, 1)) in order, for as long as
 * each is the clean common case (clean_event), as the ledger's handlers would.
 * `run`: one RUN record (pages.h's RunCounts), read and written in place: in, the node's last
 * sequence number and epoch (only events of it are applied: a new epoch is the ledger's to
 * begin), the ledger's applied-event count and the count at which a sweep is due, the grant
 * runs a request keeps before they are merged, whether frees and reads wait (`wire`: a probe's
 * verdict is pending); out, where it stopped (`at`: stop when it applied them all), the last
 * sequence number and time, the applied count, and what the run applied: page transitions,
 * missing sequence numbers (all, and before the last) and, per kind (alloc, write, free, read,
 * step), how many.
 * `node`: (name, pools, handles): its pools by id, each (state, page_size, timed, live,
 * grants), and its HANDLE slots. `requests`: (index, table, make, joined): request name ->
 * index into the REQ table; make(name, applied) makes a request (at that count of applied
 * events) and returns the table; every (request, pool) whose first grants entry the run made
 * is appended to `joined`.
 * Returns None, or the exception an event raised (a bug), for the caller to raise once it has
 * taken the counts. */
PyObject *
kvg_apply_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7)
        return PyErr_Format(PyExc_TypeError, "apply_clean() takes 7 arguments (%zd given)", nargs);
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
    if (PyErr_Occurred())
        return NULL;
    npy_intp n_runs;
    RunCounts *run = kvg_records(args[4], kvg_run_descr, &n_runs, "run", "RUN");
    if (run == NULL)
        return NULL;
    if (n_runs != 1)
        return PyErr_Format(PyExc_ValueError, "apply_clean: one RUN record expected, got %zd", (Py_ssize_t)n_runs);
    if (!PyTuple_Check(args[5]) || PyTuple_GET_SIZE(args[5]) != 3 || !PyTuple_Check(args[6]) ||
        PyTuple_GET_SIZE(args[6]) != 4)
        return PyErr_Format(PyExc_TypeError, "apply_clean: node is (name, pools, handles), requests "
                                             "(index, table, make, joined)");
    if (start < 0 || stop > n_heads || start > stop)
        return PyErr_Format(PyExc_IndexError, "apply_clean: [%zd, %zd) outside %zd heads", start, stop, n_heads);
    for (Py_ssize_t i = start; i < stop; i++) /* the heads must lie in the bytes (batch() made them so) */
        if (c.heads[i].end > (uint64_t)len || c.heads[i].pay_end > c.heads[i].end ||
            c.heads[i].node_end > c.heads[i].end || c.heads[i].req_end > c.heads[i].end)
            return PyErr_Format(PyExc_ValueError, "apply_clean: head %zd lies outside the bytes", i);
    if (!(c.name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(args[5], 0), &c.name_len)))
        return NULL;
    c.pools = PyTuple_GET_ITEM(args[5], 1);
    c.req_index = PyTuple_GET_ITEM(args[6], 0);
    c.make = PyTuple_GET_ITEM(args[6], 2);
    c.joined = PyTuple_GET_ITEM(args[6], 3);
    if (!PyDict_Check(c.pools) || !PyDict_Check(c.req_index) || !PyList_Check(c.joined))
        return PyErr_Format(PyExc_TypeError, "apply_clean: pools and the request index are dicts, joined a list");
    if (!(c.reqs = kvg_records(PyTuple_GET_ITEM(args[6], 1), kvg_req_descr, &c.n_reqs, "reqs", "REQ")) ||
        !(c.handles = kvg_records(PyTuple_GET_ITEM(args[5], 2), kvg_handle_descr, &c.n_handles, "handles", "HANDLE")))
        return NULL;
    c.last_seq = run->last_seq;
    c.epoch = run->epoch;
    c.applied = run->applied;
    c.next_sweep = run->next_sweep;
    c.grant_runs = run->grant_runs;
    c.wire = run->wire != 0;
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
     * the ledger stays whole: the error comes back, for the caller to raise then. */
    run->at = i;
    run->last_seq = c.last_seq;
    run->last_ts = c.last_ts;
    run->applied = c.applied;
    run->transitions = c.transitions;
    run->missing = c.missing;
    run->last_missing = c.last_missing;
    memcpy(run->kinds, c.kinds, sizeof(run->kinds));
    if (failed) {
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyErr_NormalizeException(&type, &value, &trace);
        Py_XDECREF(type);
        Py_XDECREF(trace);
        if (value != NULL)
            return value;
    }
    Py_RETURN_NONE;
}
