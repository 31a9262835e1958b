/* kvguard.proto._wire: kvguard.v1 events read from, and written to, their bytes in C, for the
 * events every request makes (proto/wire.py is its Python face).
 *
 * - head(body): one event's head (wire.h), or None where protobuf must read it;
 * - batch(data, wrapped): the heads of a batch's events, one pass over its bytes, as HEAD
 *   records (the events stay where they are in `data`);
 * - encode(kind, node, seq, ts, epoch, req, pool, pages, slots): an alloc, write or free
 *   event's bytes, as protobuf would serialize it, from int64 arrays (no Python int per page);
 * - encode_step(node, seq, ts, epoch, pool, reqs, counts, pages, slots): a step's bytes;
 * - encode_allocs, encode_pass: a batch of alloc events (and the step after them).
 *
 * Invariant: what is read here is what protobuf reads of the same bytes, and what is written
 * is what protobuf writes; anything else is left to protobuf (wire.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>
#include <stddef.h>

#include "wire.h"

static PyArray_Descr *head_descr; /* HEAD: WireHead as a NumPy dtype */

/* head(body) -> (kind, node, seq, ts_ns, req, pool, tokens, start, end, epoch) or None
 * The plain shape only (an alloc, a write without slots, a free, a one-entry read): [start,
 * end) are the payload's bytes (a read's entry), whose field 3 lists the pages. None for any
 * other event, unusual bytes, or a node or req that is not UTF-8. */
static PyObject *
head(PyObject *self, PyObject *body)
{
    (void)self;
    if (!PyBytes_Check(body))
        return PyErr_Format(PyExc_TypeError, "head: bytes expected, got %.80s", Py_TYPE(body)->tp_name);
    const char *base = PyBytes_AS_STRING(body);
    WireHead h;
    if (PyBytes_GET_SIZE(body) > (Py_ssize_t)UINT32_MAX)
        Py_RETURN_NONE;
    wire_head((const uint8_t *)base, 0, PyBytes_GET_SIZE(body), &h);
    if (h.plain != 1 || h.kind == WIRE_STEP) /* a write's slots, a step: the ledger's C, or protobuf */
        Py_RETURN_NONE;
    PyObject *node = PyUnicode_DecodeUTF8(base + h.node_start, h.node_end - h.node_start, NULL);
    PyObject *req = node ? PyUnicode_DecodeUTF8(base + h.req_start, h.req_end - h.req_start, NULL) : NULL;
    if (req == NULL) {
        PyErr_Clear();
        Py_XDECREF(node);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(iNKLNKKIIK)", h.kind, node, (unsigned long long)h.seq, (long long)h.ts, req,
                         (unsigned long long)h.pool, (unsigned long long)h.tokens, h.pay_start, h.pay_end,
                         (unsigned long long)h.epoch);
}

/* single(body) -> HEAD array of one: the head of the event `body` (kind 0 where protobuf must
 * read it, as in a batch). */
static PyObject *
single(PyObject *self, PyObject *body)
{
    (void)self;
    if (!PyBytes_Check(body))
        return PyErr_Format(PyExc_TypeError, "single: bytes expected, got %.80s", Py_TYPE(body)->tp_name);
    npy_intp dims[1] = {1};
    Py_INCREF(head_descr);
    PyArrayObject *out = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, head_descr, 1, dims, NULL, NULL, 0, NULL);
    if (out == NULL)
        return NULL;
    WireHead *h = PyArray_DATA(out);
    if (PyBytes_GET_SIZE(body) > (Py_ssize_t)UINT32_MAX)
        memset(h, 0, sizeof(*h));
    else
        wire_head((const uint8_t *)PyBytes_AS_STRING(body), 0, PyBytes_GET_SIZE(body), h);
    return (PyObject *)out;
}

/* batch(data, wrapped) -> HEAD array or None
 * The heads of the events of an EventBatch (or, wrapped, of an AgentMessage holding one),
 * in order; None when the bytes are anything else (protobuf then says what they are). */
static PyObject *
batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2)
        return PyErr_Format(PyExc_TypeError, "batch() takes 2 arguments (%zd given)", nargs);
    if (!PyBytes_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "batch: bytes expected, got %.80s", Py_TYPE(args[0])->tp_name);
    int wrapped = PyObject_IsTrue(args[1]);
    if (wrapped < 0)
        return NULL;
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t n = wire_batch(data, len, wrapped, NULL, 0);
    if (n < 0)
        Py_RETURN_NONE;
    npy_intp dims[1] = {n};
    Py_INCREF(head_descr);
    PyArrayObject *out = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, head_descr, 1, dims, NULL, NULL, 0, NULL);
    if (out == NULL)
        return NULL;
    if (n && wire_batch(data, len, wrapped, PyArray_DATA(out), n) != n) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return (PyObject *)out;
}

/* of_node(data, heads, node) -> uint8 array
 * For each head of `data`: 1 if its event is of node `node` (UTF-8 bytes), 0 if of another
 * node, 2 where the envelope was not read here (protobuf must say whose it is). */
static PyObject *
of_node(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "of_node() takes 3 arguments (%zd given)", nargs);
    if (!PyBytes_Check(args[0]) || !PyBytes_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "of_node: bytes expected");
    PyObject *array = args[1];
    if (!PyArray_Check(array) || !PyArray_EquivTypes(PyArray_DESCR((PyArrayObject *)array), head_descr) ||
        PyArray_NDIM((PyArrayObject *)array) != 1 || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array))
        return PyErr_Format(PyExc_TypeError, "of_node: a contiguous HEAD array expected");
    const char *data = PyBytes_AS_STRING(args[0]), *node = PyBytes_AS_STRING(args[2]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]), node_len = PyBytes_GET_SIZE(args[2]);
    const WireHead *heads = PyArray_DATA((PyArrayObject *)array);
    npy_intp n = PyArray_DIM((PyArrayObject *)array, 0);
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_UINT8);
    if (out == NULL)
        return NULL;
    uint8_t *mine = PyArray_DATA(out);
    for (npy_intp i = 0; i < n; i++) {
        const WireHead *h = &heads[i];
        if (!h->kind || h->node_end > (uint64_t)len || h->node_start > h->node_end)
            mine[i] = 2;
        else
            mine[i] = h->node_end - h->node_start == (uint64_t)node_len &&
                      memcmp(data + h->node_start, node, (size_t)node_len) == 0;
    }
    return (PyObject *)out;
}

/* ---------------------------------------------------------------- writing */

typedef struct {
    uint8_t *at;
} Out;

static inline void
put_varint(Out *o, uint64_t v)
{
    while (v >= 0x80) {
        *o->at++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *o->at++ = (uint8_t)v;
}

static inline void
put_bytes(Out *o, uint64_t number, const char *data, Py_ssize_t len)
{
    put_varint(o, number << 3 | 2);
    put_varint(o, (uint64_t)len);
    memcpy(o->at, data, (size_t)len);
    o->at += len;
}

/* The bytes of the varints of `values` (each in [0, 2^32), else -1 with ValueError naming it). */
static Py_ssize_t
packed_size(const int64_t *values, Py_ssize_t n, const char *what)
{
    Py_ssize_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (values[i] < 0 || values[i] > (int64_t)UINT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: %lld at %zd is not a uint32", what, (long long)values[i], i);
            return -1;
        }
        size += wire_varint_size((uint64_t)values[i]);
    }
    return size;
}

static const int64_t *
int64_data(PyObject *o, Py_ssize_t *n, const char *what)
{
    if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != NPY_INT64 || PyArray_NDIM((PyArrayObject *)o) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o)) {
        PyErr_Format(PyExc_TypeError, "%s: a contiguous 1-d int64 array expected", what);
        return NULL;
    }
    *n = PyArray_DIM((PyArrayObject *)o, 0);
    return PyArray_DATA((PyArrayObject *)o);
}

/* An event's envelope as encode() and encode_step() take it: node, seq, ts, epoch. */
typedef struct {
    const char *node;
    Py_ssize_t node_len;
    uint64_t seq, epoch;
    int64_t ts;
} Envelope;

static int
envelope(PyObject *const *args, Envelope *env)
{
    env->seq = PyLong_AsUnsignedLongLong(args[1]);
    env->ts = PyLong_AsLongLong(args[2]);
    env->epoch = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return -1;
    env->node = PyUnicode_AsUTF8AndSize(args[0], &env->node_len);
    return env->node == NULL ? -1 : 0;
}

static Py_ssize_t
envelope_size(const Envelope *env)
{
    Py_ssize_t size = 0;
    if (env->node_len)
        size += 1 + wire_varint_size((uint64_t)env->node_len) + env->node_len;
    if (env->seq)
        size += 1 + wire_varint_size(env->seq);
    if (env->ts)
        size += 1 + wire_varint_size((uint64_t)env->ts);
    if (env->epoch)
        size += 1 + wire_varint_size(env->epoch);
    return size;
}

/* The envelope's fields in their order (defaults left out, as protobuf does). */
static void
put_envelope(Out *o, const Envelope *env)
{
    if (env->node_len)
        put_bytes(o, 1, env->node, env->node_len);
    if (env->seq) {
        put_varint(o, 2 << 3);
        put_varint(o, env->seq);
    }
    if (env->ts) {
        put_varint(o, 3 << 3);
        put_varint(o, (uint64_t)env->ts);
    }
    if (env->epoch) {
        put_varint(o, 4 << 3);
        put_varint(o, env->epoch);
    }
}

/* Field `number`, packed: n values of `size` bytes as varints (nothing when n is 0). */
static void
put_packed(Out *o, uint64_t number, const int64_t *values, Py_ssize_t n, Py_ssize_t size)
{
    if (!n)
        return;
    put_varint(o, number << 3 | 2);
    put_varint(o, (uint64_t)size);
    for (Py_ssize_t i = 0; i < n; i++)
        put_varint(o, (uint64_t)values[i]);
}

/* A page event's payload: req, pool, the packed pages (pages_size bytes) and slots. */
typedef struct {
    const char *req;
    Py_ssize_t req_len;
    unsigned long pool;
    const int64_t *pages, *slots;
    Py_ssize_t n_pages, n_slots, pages_size, slots_size;
} PagePayload;

static Py_ssize_t
payload_size(const PagePayload *p)
{
    Py_ssize_t size = 0;
    if (p->req_len)
        size += 1 + wire_varint_size((uint64_t)p->req_len) + p->req_len;
    if (p->pool)
        size += 1 + wire_varint_size(p->pool);
    if (p->n_pages)
        size += 1 + wire_varint_size((uint64_t)p->pages_size) + p->pages_size;
    if (p->n_slots)
        size += 1 + wire_varint_size((uint64_t)p->slots_size) + p->slots_size;
    return size;
}

/* The whole event's size: the envelope, the payload's tag, length and bytes. */
static Py_ssize_t
event_size(const Envelope *env, long kind, Py_ssize_t payload)
{
    return envelope_size(env) + wire_varint_size((uint64_t)kind << 3 | 2) + wire_varint_size((uint64_t)payload) +
           payload;
}

static void
put_event(Out *o, const Envelope *env, long kind, const PagePayload *p, Py_ssize_t payload)
{
    put_envelope(o, env);
    put_varint(o, (uint64_t)kind << 3 | 2);
    put_varint(o, (uint64_t)payload);
    if (p->req_len)
        put_bytes(o, 1, p->req, p->req_len);
    if (p->pool) {
        put_varint(o, 2 << 3);
        put_varint(o, p->pool);
    }
    put_packed(o, WIRE_PAGES, p->pages, p->n_pages, p->pages_size);
    put_packed(o, 4, p->slots, p->n_slots, p->slots_size);
}

/* A bug, if the bytes written are not the bytes sized: SystemError, the bytes dropped. */
static PyObject *
written(PyObject *bytes, const Out *o, Py_ssize_t total, const char *what)
{
    Py_ssize_t wrote = (Py_ssize_t)((char *)o->at - PyBytes_AS_STRING(bytes));
    if (wrote == total)
        return bytes;
    Py_DECREF(bytes);
    return PyErr_Format(PyExc_SystemError, "%s: wrote %zd of %zd bytes", what, wrote, total);
}

/* encode_allocs(node, seq, ts, epoch, reqs, pool, pages, counts) -> bytes
 * An EventBatch of one alloc event a request: reqs[i] granted the next counts[i] of `pages`,
 * numbered seq, seq + 1, ..., each as encode() writes it, framed as protobuf frames them.
 * reqs a list of str; pages, counts contiguous int64 arrays (counts adding up to the pages). */
static PyObject *
encode_allocs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8)
        return PyErr_Format(PyExc_TypeError, "encode_allocs() takes 8 arguments (%zd given)", nargs);
    Envelope env;
    if (envelope(args, &env) < 0)
        return NULL;
    unsigned long pool = PyLong_AsUnsignedLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (pool > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "encode_allocs: pool %lu is not a uint32", pool);
    PyObject *reqs = args[4];
    if (!PyList_Check(reqs))
        return PyErr_Format(PyExc_TypeError, "encode_allocs: reqs must be a list of str");
    Py_ssize_t n = PyList_GET_SIZE(reqs), n_pages, n_counts;
    const int64_t *pages = int64_data(args[6], &n_pages, "pages"), *counts = NULL;
    if (pages == NULL || !(counts = int64_data(args[7], &n_counts, "counts")))
        return NULL;
    if (n_counts != n)
        return PyErr_Format(PyExc_ValueError, "encode_allocs: %zd requests, %zd counts", n, n_counts);
    Py_ssize_t total = 0, at = 0;
    uint64_t seq = env.seq;
    for (Py_ssize_t i = 0; i < n; i++) { /* first the sizes, checking every value */
        PagePayload p = {.pool = pool, .pages = pages + at, .n_pages = counts[i]};
        if (!PyUnicode_Check(PyList_GET_ITEM(reqs, i)))
            return PyErr_Format(PyExc_TypeError, "encode_allocs: reqs[%zd] is not a str", i);
        if (counts[i] < 0 || counts[i] > n_pages - at)
            return PyErr_Format(PyExc_ValueError, "encode_allocs: the counts run past the %zd pages", n_pages);
        if (!(p.req = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(reqs, i), &p.req_len)) ||
            (p.pages_size = packed_size(p.pages, p.n_pages, "pages")) < 0)
            return NULL;
        env.seq = seq + (uint64_t)i;
        Py_ssize_t size = event_size(&env, WIRE_ALLOC, payload_size(&p));
        total += 1 + wire_varint_size((uint64_t)size) + size;
        at += counts[i];
    }
    if (at != n_pages)
        return PyErr_Format(PyExc_ValueError, "encode_allocs: the counts add up to %zd of %zd pages", at, n_pages);
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        return NULL;
    Out o = {(uint8_t *)PyBytes_AS_STRING(bytes)};
    at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PagePayload p = {.pool = pool, .pages = pages + at, .n_pages = counts[i]};
        p.req = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(reqs, i), &p.req_len); /* cached above */
        p.pages_size = packed_size(p.pages, p.n_pages, "pages");
        env.seq = seq + (uint64_t)i;
        Py_ssize_t payload = payload_size(&p);
        put_varint(&o, 1 << 3 | 2); /* EventBatch.events */
        put_varint(&o, (uint64_t)event_size(&env, WIRE_ALLOC, payload));
        put_event(&o, &env, WIRE_ALLOC, &p, payload);
        at += counts[i];
    }
    return written(bytes, &o, total, "encode_allocs");
}

/* encode(kind, node, seq, ts, epoch, req, pool, pages, slots) -> bytes
 * An Event whose payload (field `kind`: alloc, write, free, hold, release, share, scrub: the
 * payloads whose fields 1-3 are req, pool, pages) holds req, pool and the packed `pages`, and
 * for a write the packed `slots` (None: none), byte for byte as protobuf serializes it
 * (fields in order, defaults left out). pages, slots: contiguous int64 arrays. */
static PyObject *
encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "encode() takes 9 arguments (%zd given)", nargs);
    long kind = PyLong_AsLong(args[0]);
    Envelope env;
    if (envelope(args + 1, &env) < 0)
        return NULL;
    unsigned long pool = PyLong_AsUnsignedLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (kind < WIRE_FIRST_PAYLOAD || kind > WIRE_LAST_PAYLOAD)
        return PyErr_Format(PyExc_ValueError, "encode: payload field %ld", kind);
    if (pool > UINT32_MAX)
        return PyErr_Format(PyExc_ValueError, "encode: pool %lu is not a uint32", pool);
    PagePayload p = {.pool = pool};
    if (!(p.req = PyUnicode_AsUTF8AndSize(args[5], &p.req_len)) ||
        !(p.pages = int64_data(args[7], &p.n_pages, "pages")))
        return NULL;
    if (args[8] != Py_None && !(p.slots = int64_data(args[8], &p.n_slots, "slots")))
        return NULL;
    if ((p.pages_size = packed_size(p.pages, p.n_pages, "pages")) < 0 ||
        (p.slots_size = packed_size(p.slots, p.n_slots, "slots")) < 0)
        return NULL;
    Py_ssize_t payload = payload_size(&p), total = event_size(&env, kind, payload);
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        return NULL;
    Out o = {(uint8_t *)PyBytes_AS_STRING(bytes)};
    put_event(&o, &env, kind, &p, payload);
    return written(bytes, &o, total, "encode");
}

/* A step's payload: pool, the requests' names, and counts, pages and slots (packed). */
typedef struct {
    unsigned long pool;
    PyObject *reqs; /* a list of str */
    const int64_t *counts, *pages, *slots;
    Py_ssize_t n_reqs, n_counts, n_pages, n_slots, counts_size, pages_size, slots_size, size;
} StepPayload;

/* A step's payload from args pool, reqs, counts, pages, slots (None: none), every value
 * checked and its size found; -1 with TypeError or ValueError naming what does not fit. */
static int
step_payload(PyObject *const *args, StepPayload *p, const char *what)
{
    p->pool = PyLong_AsUnsignedLong(args[0]);
    if (PyErr_Occurred())
        return -1;
    if (p->pool > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: pool %lu is not a uint32", what, p->pool);
        return -1;
    }
    p->reqs = args[1];
    if (!PyList_Check(p->reqs)) {
        PyErr_Format(PyExc_TypeError, "%s: reqs must be a list of str, not %.80s", what, Py_TYPE(p->reqs)->tp_name);
        return -1;
    }
    p->n_reqs = PyList_GET_SIZE(p->reqs);
    p->n_slots = 0;
    p->slots = NULL;
    if (!(p->counts = int64_data(args[2], &p->n_counts, "counts")) ||
        !(p->pages = int64_data(args[3], &p->n_pages, "pages")))
        return -1;
    if (args[4] != Py_None && !(p->slots = int64_data(args[4], &p->n_slots, "slots")))
        return -1;
    Py_ssize_t payload = 0, size;
    for (Py_ssize_t i = 0; i < p->n_reqs; i++) {
        if (!PyUnicode_Check(PyList_GET_ITEM(p->reqs, i))) {
            PyErr_Format(PyExc_TypeError, "%s: reqs[%zd] is %.80s, not str", what, i,
                         Py_TYPE(PyList_GET_ITEM(p->reqs, i))->tp_name);
            return -1;
        }
        if (PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(p->reqs, i), &size) == NULL)
            return -1;
        payload += 1 + wire_varint_size((uint64_t)size) + size;
    }
    if ((p->counts_size = packed_size(p->counts, p->n_counts, "counts")) < 0 ||
        (p->pages_size = packed_size(p->pages, p->n_pages, "pages")) < 0 ||
        (p->slots_size = packed_size(p->slots, p->n_slots, "slots")) < 0)
        return -1;
    if (p->pool)
        payload += 1 + wire_varint_size(p->pool);
    if (p->n_counts)
        payload += 1 + wire_varint_size((uint64_t)p->counts_size) + p->counts_size;
    if (p->n_pages)
        payload += 1 + wire_varint_size((uint64_t)p->pages_size) + p->pages_size;
    if (p->n_slots)
        payload += 1 + wire_varint_size((uint64_t)p->slots_size) + p->slots_size;
    p->size = payload;
    return 0;
}

static void
put_step(Out *o, const Envelope *env, const StepPayload *p)
{
    put_envelope(o, env);
    put_varint(o, (uint64_t)WIRE_STEP << 3 | 2);
    put_varint(o, (uint64_t)p->size);
    if (p->pool) {
        put_varint(o, 1 << 3);
        put_varint(o, p->pool);
    }
    for (Py_ssize_t i = 0; i < p->n_reqs; i++) {
        Py_ssize_t size;
        const char *name = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(p->reqs, i), &size); /* cached */
        put_bytes(o, 2, name, size);
    }
    put_packed(o, 3, p->counts, p->n_counts, p->counts_size);
    put_packed(o, 4, p->pages, p->n_pages, p->pages_size);
    put_packed(o, 5, p->slots, p->n_slots, p->slots_size);
}

/* encode_step(node, seq, ts, epoch, pool, reqs, counts, pages, slots) -> bytes
 * A step event: reqs a list of str, counts, pages and slots (None: none) contiguous int64
 * arrays, byte for byte as protobuf serializes it. ValueError naming what does not fit. */
static PyObject *
encode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9)
        return PyErr_Format(PyExc_TypeError, "encode_step() takes 9 arguments (%zd given)", nargs);
    Envelope env;
    StepPayload p;
    if (envelope(args, &env) < 0 || step_payload(args + 4, &p, "encode_step") < 0)
        return NULL;
    Py_ssize_t total = event_size(&env, WIRE_STEP, p.size);
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        return NULL;
    Out o = {(uint8_t *)PyBytes_AS_STRING(bytes)};
    put_step(&o, &env, &p);
    return written(bytes, &o, total, "encode_step");
}

/* encode_pass(node, seq, ts, epoch, pool, reqs, counts, pages, slots, grants) -> bytes
 * A forward pass as an EventBatch: first an alloc event for each request i with grants[i] > 0
 * (the last grants[i] of its counts[i] pages, in request order, each as encode() writes it),
 * numbered from seq; then the step (encode_step's) with the next number. grants: a contiguous
 * int64 array, one count a request, none above its count. */
static PyObject *
encode_pass(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 10)
        return PyErr_Format(PyExc_TypeError, "encode_pass() takes 10 arguments (%zd given)", nargs);
    Envelope env;
    StepPayload step;
    Py_ssize_t n_grants;
    const int64_t *grants;
    if (envelope(args, &env) < 0 || step_payload(args + 4, &step, "encode_pass") < 0 ||
        !(grants = int64_data(args[9], &n_grants, "grants")))
        return NULL;
    if (step.n_counts != step.n_reqs || n_grants != step.n_reqs)
        return PyErr_Format(PyExc_ValueError, "encode_pass: %zd requests, %zd counts, %zd grants", step.n_reqs,
                            step.n_counts, n_grants);
    uint64_t seq = env.seq;
    Py_ssize_t total = 0, at = 0;
    for (int pass = 0; pass < 2; pass++) { /* the sizes first, checking every value; then the bytes */
        PyObject *bytes = NULL;
        Out o = {NULL};
        if (pass) {
            if (!(bytes = PyBytes_FromStringAndSize(NULL, total)))
                return NULL;
            o.at = (uint8_t *)PyBytes_AS_STRING(bytes);
        }
        env.seq = seq;
        at = 0;
        for (Py_ssize_t i = 0; i < step.n_reqs; i++) {
            int64_t count = step.counts[i], granted = grants[i];
            if (!pass && (count < 0 || count > step.n_pages - at))
                return PyErr_Format(PyExc_ValueError, "encode_pass: the counts run past the %zd pages", step.n_pages);
            if (!pass && (granted < 0 || granted > count))
                return PyErr_Format(PyExc_ValueError, "encode_pass: grants[%zd] is %lld of %lld pages", i,
                                    (long long)granted, (long long)count);
            at += count;
            if (!granted)
                continue;
            PagePayload p = {.pool = step.pool, .pages = step.pages + at - granted, .n_pages = granted};
            p.req = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(step.reqs, i), &p.req_len); /* checked above */
            p.pages_size = packed_size(p.pages, p.n_pages, "pages");
            Py_ssize_t payload = payload_size(&p), size = event_size(&env, WIRE_ALLOC, payload);
            if (pass) {
                put_varint(&o, 1 << 3 | 2); /* EventBatch.events */
                put_varint(&o, (uint64_t)size);
                put_event(&o, &env, WIRE_ALLOC, &p, payload);
            } else
                total += 1 + wire_varint_size((uint64_t)size) + size;
            env.seq++;
        }
        if (!pass && at != step.n_pages)
            return PyErr_Format(PyExc_ValueError, "encode_pass: the counts add up to %zd of %zd pages", at,
                                step.n_pages);
        Py_ssize_t size = event_size(&env, WIRE_STEP, step.size);
        if (!pass) {
            total += 1 + wire_varint_size((uint64_t)size) + size;
            continue;
        }
        put_varint(&o, 1 << 3 | 2);
        put_varint(&o, (uint64_t)size);
        put_step(&o, &env, &step);
        return written(bytes, &o, total, "encode_pass");
    }
    return NULL; /* not reached */
}

/* digests(data, heads, start, stop) -> int64[stop - start]
 * Each event's digest, as Python's hash() of its bytes (SipHash, keyed per process): the
 * daemon tells a repeated event from a tampered copy by it. */
static PyObject *
digests(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "digests() takes 4 arguments (%zd given)", nargs);
    PyObject *array = args[1];
    if (!PyBytes_Check(args[0]) || !PyArray_Check(array) ||
        PyArray_ITEMSIZE((PyArrayObject *)array) != sizeof(WireHead) || PyArray_NDIM((PyArrayObject *)array) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array))
        return PyErr_Format(PyExc_TypeError, "digests: bytes and a contiguous HEAD array expected");
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), stop = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    npy_intp n = PyArray_DIM((PyArrayObject *)array, 0);
    if (start < 0 || stop > n || start > stop)
        return PyErr_Format(PyExc_IndexError, "digests: [%zd, %zd) outside %zd heads", start, stop, (Py_ssize_t)n);
    const char *data = PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    const WireHead *heads = PyArray_DATA((PyArrayObject *)array);
    npy_intp count = stop - start;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &count, NPY_INT64);
    if (out == NULL)
        return NULL;
    int64_t *digest = PyArray_DATA(out);
    for (npy_intp i = 0; i < count; i++) {
        const WireHead *h = &heads[start + i];
        if (h->end > (uint64_t)len || h->start > h->end) {
            Py_DECREF(out);
            return PyErr_Format(PyExc_ValueError, "digests: head %zd lies outside the bytes", (Py_ssize_t)(start + i));
        }
        Py_hash_t hash = _Py_HashBytes(data + h->start, (Py_ssize_t)(h->end - h->start));
        digest[i] = hash == -1 ? -2 : hash; /* as hash() answers */
    }
    return (PyObject *)out;
}

static PyMethodDef methods[] = {
    {"digests", (PyCFunction)(void (*)(void))digests, METH_FASTCALL, "Each event's digest (hash of its bytes)."},
    {"head", (PyCFunction)head, METH_O, "One event's head, for the plain shape."},
    {"single", (PyCFunction)single, METH_O, "One event's head, as a batch of one."},
    {"batch", (PyCFunction)(void (*)(void))batch, METH_FASTCALL, "The heads of a batch's events."},
    {"of_node", (PyCFunction)(void (*)(void))of_node, METH_FASTCALL, "Which events are a node's."},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL, "A page event's bytes."},
    {"encode_step", (PyCFunction)(void (*)(void))encode_step, METH_FASTCALL, "A step event's bytes."},
    {"encode_pass", (PyCFunction)(void (*)(void))encode_pass, METH_FASTCALL, "A pass's grants and step, as a batch."},
    {"encode_allocs", (PyCFunction)(void (*)(void))encode_allocs, METH_FASTCALL, "Alloc events as a batch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.proto._wire",
    .m_doc = "kvguard.v1 events read from and written to their bytes.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__wire(void)
{
    import_array();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
#define OFFSET(field) ((Py_ssize_t)offsetof(WireHead, field))
    PyObject *spec = Py_BuildValue(
        "{s:[ssssssssssssssss],s:[ssssssssssssssss],s:[nnnnnnnnnnnnnnnn],s:n}", "names", "kind", "plain", "batched",
        "start", "end", "node_start", "node_end", "req_start", "req_end", "pay_start", "pay_end", "pool", "seq", "ts",
        "tokens", "epoch", "formats", "u1", "u1", "<u2", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4",
        "<u8", "<i8", "<u8", "<u8", "offsets", OFFSET(kind), OFFSET(plain), OFFSET(batched), OFFSET(start),
        OFFSET(end), OFFSET(node_start), OFFSET(node_end), OFFSET(req_start), OFFSET(req_end), OFFSET(pay_start),
        OFFSET(pay_end), OFFSET(pool), OFFSET(seq), OFFSET(ts), OFFSET(tokens), OFFSET(epoch), "itemsize",
        (Py_ssize_t)sizeof(WireHead));
#undef OFFSET
    if (spec == NULL || !PyArray_DescrConverter(spec, &head_descr) ||
        PyModule_AddObjectRef(m, "HEAD", (PyObject *)head_descr) < 0) {
        Py_XDECREF(spec);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(spec);
    return m;
}
