/* kvguard.proto._wire's writing half: the common events written from arrays, byte for byte
 * as protobuf writes them (proto/encode.h declares the entry points; _wire.c registers them).
 *
 * Invariant: every value is checked and every size counted before a byte is written; the
 * bytes written are the bytes sized (SystemError otherwise: a bug).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL kvguard_proto_wire_ARRAY_API
#define NO_IMPORT_ARRAY /* _wire.c imports NumPy's API */
#include <numpy/arrayobject.h>

#include "encode.h"
#include "wire.h"

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

/* Alloc events, framed as EventBatch entries: request i granted the last grants[i] of its
 * counts[i] pages (grants NULL: all of them, an event each even of 0 pages; with grants, a
 * request granted none has no event), numbered on from env->seq, which it advances. With o
 * NULL, every value is checked and the bytes are added to *total (-1 with an exception
 * naming `what` where one does not fit); else written. */
static int
put_allocs(Out *o, Envelope *env, unsigned long pool, PyObject *reqs, const int64_t *counts, const int64_t *grants,
           const int64_t *pages, Py_ssize_t n_pages, Py_ssize_t *total, const char *what)
{
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(reqs); i++) {
        int64_t count = counts[i], granted = grants ? grants[i] : count;
        if (!o) {
            if (!PyUnicode_Check(PyList_GET_ITEM(reqs, i))) {
                PyErr_Format(PyExc_TypeError, "%s: reqs[%zd] is %.80s, not str", what, i,
                             Py_TYPE(PyList_GET_ITEM(reqs, i))->tp_name);
                return -1;
            }
            if (count < 0 || count > n_pages - at) {
                PyErr_Format(PyExc_ValueError, "%s: the counts run past the %zd pages", what, n_pages);
                return -1;
            }
            if (granted < 0 || granted > count) {
                PyErr_Format(PyExc_ValueError, "%s: grants[%zd] is %lld of %lld pages", what, i, (long long)granted,
                             (long long)count);
                return -1;
            }
        }
        at += count;
        if (grants && !granted) /* a pass's request granted nothing; encode_allocs' each get one */
            continue;
        PagePayload p = {.pool = pool, .pages = pages + at - granted, .n_pages = granted};
        if (!(p.req = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(reqs, i), &p.req_len)) || /* cached once read */
            (p.pages_size = packed_size(p.pages, p.n_pages, "pages")) < 0)
            return -1;
        Py_ssize_t payload = payload_size(&p), size = event_size(env, WIRE_ALLOC, payload);
        if (o) {
            put_varint(o, 1 << 3 | 2); /* EventBatch.events */
            put_varint(o, (uint64_t)size);
            put_event(o, env, WIRE_ALLOC, &p, payload);
        } else
            *total += 1 + wire_varint_size((uint64_t)size) + size;
        env->seq++;
    }
    if (!o && at != n_pages) {
        PyErr_Format(PyExc_ValueError, "%s: the counts add up to %zd of %zd pages", what, at, n_pages);
        return -1;
    }
    return 0;
}

/* encode_allocs(node, seq, ts, epoch, reqs, pool, pages, counts) -> bytes
 * An EventBatch of one alloc event a request: reqs[i] granted the next counts[i] of `pages`,
 * numbered seq, seq + 1, ..., each as encode() writes it, framed as protobuf frames them.
 * reqs a list of str; pages, counts contiguous int64 arrays (counts adding up to the pages). */
PyObject *
kvg_encode_allocs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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
    Py_ssize_t n_pages, n_counts, total = 0;
    const int64_t *pages = int64_data(args[6], &n_pages, "pages"), *counts = NULL;
    if (pages == NULL || !(counts = int64_data(args[7], &n_counts, "counts")))
        return NULL;
    if (n_counts != PyList_GET_SIZE(reqs))
        return PyErr_Format(PyExc_ValueError, "encode_allocs: %zd requests, %zd counts", PyList_GET_SIZE(reqs),
                            n_counts);
    uint64_t seq = env.seq;
    if (put_allocs(NULL, &env, pool, reqs, counts, NULL, pages, n_pages, &total, "encode_allocs") < 0)
        return NULL;
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        return NULL;
    Out o = {(uint8_t *)PyBytes_AS_STRING(bytes)};
    env.seq = seq;
    put_allocs(&o, &env, pool, reqs, counts, NULL, pages, n_pages, &total, "encode_allocs"); /* checked above */
    return written(bytes, &o, total, "encode_allocs");
}

/* encode(kind, node, seq, ts, epoch, req, pool, pages, slots) -> bytes
 * An Event whose payload (field `kind`: alloc, write, free, hold, release, share, scrub: the
 * payloads whose fields 1-3 are req, pool, pages) holds req, pool and the packed `pages`, and
 * for a write the packed `slots` (None: none), byte for byte as protobuf serializes it
 * (fields in order, defaults left out). pages, slots: contiguous int64 arrays. */
PyObject *
kvg_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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

/* A step's payload: pool, the requests (names, or handles), and counts, pages, slots and
 * grants (packed). */
typedef struct {
    unsigned long pool;
    PyObject *reqs; /* a list of str, or NULL when the requests are given by handles */
    const int64_t *counts, *pages, *slots, *handles, *grants;
    Py_ssize_t n_reqs, n_counts, n_pages, n_slots, n_handles, n_grants, counts_size, pages_size, slots_size,
        handles_size, grants_size, size;
} StepPayload;

/* A step's payload from args pool, reqs (a list of str, or an int64 array of handles), counts,
 * pages, slots (None: none), every value checked and its size found; -1 with TypeError or
 * ValueError naming what does not fit. */
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
    p->n_slots = p->n_handles = p->n_grants = 0;
    p->slots = p->handles = p->grants = NULL;
    if (PyArray_Check(p->reqs)) { /* handles */
        if (!(p->handles = int64_data(p->reqs, &p->n_handles, "handles")))
            return -1;
        for (Py_ssize_t i = 0; i < p->n_handles; i++)
            if (p->handles[i] <= 0 || p->handles[i] > UINT32_MAX) {
                PyErr_Format(PyExc_ValueError, "%s: handle %lld is not one (1 to 2^32-1)", what,
                             (long long)p->handles[i]);
                return -1;
            }
        p->reqs = NULL;
        p->n_reqs = p->n_handles;
    } else if (!PyList_Check(p->reqs)) {
        PyErr_Format(PyExc_TypeError, "%s: reqs must be a list of str or an array of handles, not %.80s", what,
                     Py_TYPE(p->reqs)->tp_name);
        return -1;
    } else {
        p->n_reqs = PyList_GET_SIZE(p->reqs);
    }
    if (!(p->counts = int64_data(args[2], &p->n_counts, "counts")) ||
        !(p->pages = int64_data(args[3], &p->n_pages, "pages")))
        return -1;
    if (args[4] != Py_None && !(p->slots = int64_data(args[4], &p->n_slots, "slots")))
        return -1;
    Py_ssize_t payload = 0, size;
    for (Py_ssize_t i = 0; p->reqs != NULL && i < p->n_reqs; i++) {
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
        (p->slots_size = packed_size(p->slots, p->n_slots, "slots")) < 0 ||
        (p->handles_size = packed_size(p->handles, p->n_handles, "handles")) < 0)
        return -1;
    if (p->pool)
        payload += 1 + wire_varint_size(p->pool);
    if (p->n_counts)
        payload += 1 + wire_varint_size((uint64_t)p->counts_size) + p->counts_size;
    if (p->n_pages)
        payload += 1 + wire_varint_size((uint64_t)p->pages_size) + p->pages_size;
    if (p->n_slots)
        payload += 1 + wire_varint_size((uint64_t)p->slots_size) + p->slots_size;
    if (p->n_handles)
        payload += 1 + wire_varint_size((uint64_t)p->handles_size) + p->handles_size;
    p->size = payload;
    return 0;
}

/* The step's grants (args: an int64 array, one a request, none above its count; None: none)
 * into p, its size with them; -1 with ValueError naming what does not fit. */
static int
step_grants(PyObject *arg, StepPayload *p, const char *what)
{
    if (arg == Py_None)
        return 0;
    if (!(p->grants = int64_data(arg, &p->n_grants, "grants")) ||
        (p->grants_size = packed_size(p->grants, p->n_grants, "grants")) < 0)
        return -1;
    if (p->n_grants != p->n_reqs || p->n_counts != p->n_reqs) {
        PyErr_Format(PyExc_ValueError, "%s: %zd requests, %zd counts, %zd grants", what, p->n_reqs, p->n_counts,
                     p->n_grants);
        return -1;
    }
    for (Py_ssize_t i = 0; i < p->n_grants; i++)
        if (p->grants[i] > p->counts[i]) {
            PyErr_Format(PyExc_ValueError, "%s: grants[%zd] = %lld is above its count %lld", what, i,
                         (long long)p->grants[i], (long long)p->counts[i]);
            return -1;
        }
    if (p->n_grants)
        p->size += 1 + wire_varint_size((uint64_t)p->grants_size) + p->grants_size;
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
    for (Py_ssize_t i = 0; p->reqs != NULL && i < p->n_reqs; i++) {
        Py_ssize_t size;
        const char *name = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(p->reqs, i), &size); /* cached */
        put_bytes(o, 2, name, size);
    }
    put_packed(o, 3, p->counts, p->n_counts, p->counts_size);
    put_packed(o, 4, p->pages, p->n_pages, p->pages_size);
    put_packed(o, 5, p->slots, p->n_slots, p->slots_size);
    put_packed(o, 6, p->handles, p->n_handles, p->handles_size);
    put_packed(o, 7, p->grants, p->n_grants, p->grants_size);
}

/* encode_step(node, seq, ts, epoch, pool, reqs, counts, pages, slots[, grants]) -> bytes
 * A step event: reqs a list of str (names) or a contiguous int64 array (handles); counts, pages,
 * slots and grants (None: none) contiguous int64 arrays; byte for byte as protobuf serializes
 * it. ValueError naming what does not fit. */
PyObject *
kvg_encode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9 && nargs != 10)
        return PyErr_Format(PyExc_TypeError, "encode_step() takes 9 or 10 arguments (%zd given)", nargs);
    Envelope env;
    StepPayload p;
    if (envelope(args, &env) < 0 || step_payload(args + 4, &p, "encode_step") < 0 ||
        (nargs == 10 && step_grants(args[9], &p, "encode_step") < 0))
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
PyObject *
kvg_encode_pass(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
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
    if (step.reqs == NULL)
        return PyErr_Format(PyExc_TypeError, "encode_pass: its allocs name their requests: reqs must be a list of str");
    if (step.n_counts != step.n_reqs || n_grants != step.n_reqs)
        return PyErr_Format(PyExc_ValueError, "encode_pass: %zd requests, %zd counts, %zd grants", step.n_reqs,
                            step.n_counts, n_grants);
    uint64_t seq = env.seq;
    Py_ssize_t total = 0;
    if (put_allocs(NULL, &env, step.pool, step.reqs, step.counts, grants, step.pages, step.n_pages, &total,
                   "encode_pass") < 0)
        return NULL;
    Py_ssize_t size = event_size(&env, WIRE_STEP, step.size); /* the step takes the next number */
    total += 1 + wire_varint_size((uint64_t)size) + size;
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
    if (bytes == NULL)
        return NULL;
    Out o = {(uint8_t *)PyBytes_AS_STRING(bytes)};
    env.seq = seq;
    put_allocs(&o, &env, step.pool, step.reqs, step.counts, grants, step.pages, step.n_pages, &total, "encode_pass");
    put_varint(&o, 1 << 3 | 2);
    put_varint(&o, (uint64_t)size);
    put_step(&o, &env, &step);
    return written(bytes, &o, total, "encode_pass");
}

