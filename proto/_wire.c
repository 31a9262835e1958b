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
#define PY_ARRAY_UNIQUE_SYMBOL kvguard_proto_wire_ARRAY_API
#include <numpy/arrayobject.h>
#include <stddef.h>

#include "encode.h"
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
    {"encode", (PyCFunction)(void (*)(void))kvg_encode, METH_FASTCALL, "A page event's bytes."},
    {"encode_step", (PyCFunction)(void (*)(void))kvg_encode_step, METH_FASTCALL, "A step event's bytes."},
    {"encode_pass", (PyCFunction)(void (*)(void))kvg_encode_pass, METH_FASTCALL, "A pass's grants and step, as a batch."},
    {"encode_allocs", (PyCFunction)(void (*)(void))kvg_encode_allocs, METH_FASTCALL, "Alloc events as a batch."},
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
