/* kvguard.daemon._rows: the audit store's rows for a run of accepted events, from the heads
 * the daemon read once (proto/wire.h), in C: a row per event is the store's cost, so
 * consecutive events share a row.
 *
 * Invariant: the rows are exactly what daemon/store's Python rows_of makes of the same
 * events (tests compare them); only the plain shape is split here (every head plain), any
 * other batch goes through Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

#include "wire.h"

/* Adds the request data[0, len) to `names` unless it is empty or the one before (a
 * request's events come together); -1 with an exception. */
static int
add_name(PyObject *names, const uint8_t *name, Py_ssize_t len, const uint8_t **prev, Py_ssize_t *prev_len)
{
    if (len == 0 || (len == *prev_len && memcmp(name, *prev, (size_t)len) == 0))
        return 0;
    PyObject *one = PyUnicode_DecodeUTF8((const char *)name, len, NULL);
    int rc = one == NULL ? -1 : PySet_Add(names, one);
    Py_XDECREF(one);
    *prev = name;
    *prev_len = len;
    return rc;
}

/* A run's events' requests, each once, sorted, as a tuple; NULL with an exception. A step's
 * head has no request (its req span is empty): a step is not indexed by the requests of its
 * batch (daemon/store/rows.py: indexed). */
static PyObject *
run_named(const uint8_t *data, const WireHead *heads, Py_ssize_t start, Py_ssize_t stop)
{
    PyObject *names = PySet_New(NULL), *sorted = NULL, *named = NULL;
    const uint8_t *prev = NULL;
    Py_ssize_t prev_len = -1;
    for (Py_ssize_t k = start; names != NULL && k < stop; k++) {
        if (add_name(names, data + heads[k].req_start, heads[k].req_end - heads[k].req_start, &prev, &prev_len) < 0)
            Py_CLEAR(names);
    }
    if (names != NULL && (sorted = PySequence_List(names)) != NULL && PyList_Sort(sorted) == 0)
        named = PyList_AsTuple(sorted);
    Py_XDECREF(sorted);
    Py_XDECREF(names);
    return named;
}

/* split_runs(data, heads, start, stop, span_ns, run_max)
 *   -> [(start, stop, node, seq, ts_ns, req, named, body), ...] or None
 * The rows of events heads[start:stop] of `data` (one node's, accepted, in order): each row
 * takes the events from its first on while their time lies within span_ns after the first's
 * (none earlier), at most run_max. A row of one event carries its request (`req`, `named`
 * empty) and its bytes as `body`; a longer one the distinct requests its events name, sorted
 * (`named`, `req` ""), and as `body` their EventBatch (the bytes of the batch that hold them,
 * when they lie there back to back; else None: the caller builds it). node, seq and ts_ns are
 * the first event's. A step names no request here (none indexed: rows.py's `indexed`). None if
 * any event is not of the plain shape, or its node or request is
 * not UTF-8: the caller reads them all with protobuf. */
static PyObject *
split_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6)
        return PyErr_Format(PyExc_TypeError, "split_runs() takes 6 arguments (%zd given)", nargs);
    if (!PyBytes_Check(args[0]))
        return PyErr_Format(PyExc_TypeError, "split_runs: bytes expected, got %.80s", Py_TYPE(args[0])->tp_name);
    PyObject *array = args[1];
    if (!PyArray_Check(array) || PyArray_NDIM((PyArrayObject *)array) != 1 ||
        PyArray_ITEMSIZE((PyArrayObject *)array) != sizeof(WireHead) || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)array))
        return PyErr_Format(PyExc_TypeError, "split_runs: a contiguous HEAD array expected");
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    const WireHead *heads = PyArray_DATA((PyArrayObject *)array);
    Py_ssize_t n = PyArray_DIM((PyArrayObject *)array, 0);
    Py_ssize_t first = PyLong_AsSsize_t(args[2]), last = PyLong_AsSsize_t(args[3]);
    long long span_ns = PyLong_AsLongLong(args[4]);
    Py_ssize_t run_max = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred())
        return NULL;
    if (first < 0 || last > n || first > last || span_ns < 0 || run_max < 1)
        return PyErr_Format(PyExc_ValueError, "split_runs: [%zd, %zd) of %zd heads, span_ns %lld, run_max %zd", first,
                            last, n, span_ns, run_max);
    for (Py_ssize_t i = first; i < last; i++) {
        if (heads[i].end > (uint64_t)len || heads[i].req_end > heads[i].end || heads[i].node_end > heads[i].end)
            return PyErr_Format(PyExc_ValueError, "split_runs: head %zd lies outside the bytes", i);
        if (!heads[i].plain)
            Py_RETURN_NONE; /* not the plain shape: protobuf reads them */
    }
    PyObject *rows = PyList_New(0);
    if (rows == NULL)
        return NULL;
    for (Py_ssize_t start = first; start < last;) {
        int64_t t0 = heads[start].ts;
        Py_ssize_t stop = start + 1, end = last - start > run_max ? start + run_max : last;
        while (stop < end) {
            int64_t t = heads[stop].ts;
            if (t < t0 || (uint64_t)t - (uint64_t)t0 > (uint64_t)span_ns)
                break;
            stop++;
        }
        const WireHead *h = &heads[start];
        PyObject *node = PyUnicode_DecodeUTF8((const char *)data + h->node_start, h->node_end - h->node_start, NULL);
        PyObject *req = NULL, *named = NULL, *body = NULL;
        if (stop - start == 1) { /* a step's request is "" (its head's req span is empty) */
            req = PyUnicode_DecodeUTF8((const char *)data + h->req_start, h->req_end - h->req_start, NULL);
            named = PyTuple_New(0);
            body = PyBytes_FromStringAndSize((const char *)data + h->start, h->end - h->start);
        } else {
            req = PyUnicode_FromStringAndSize("", 0);
            named = run_named(data, heads, start, stop);
            int adjacent = 1;
            for (Py_ssize_t k = start; k < stop && adjacent; k++)
                adjacent = heads[k].batched && (k == start || wire_frame(&heads[k]) == heads[k - 1].end);
            body = adjacent ? PyBytes_FromStringAndSize((const char *)data + wire_frame(h), heads[stop - 1].end -
                                                                                                  wire_frame(h))
                            : Py_NewRef(Py_None);
        }
        PyObject *row = NULL;
        if (node != NULL && req != NULL && named != NULL && body != NULL)
            row = Py_BuildValue("(nnOKLOOO)", start, stop, node, (unsigned long long)h->seq, (long long)t0, req, named,
                                body);
        Py_XDECREF(node);
        Py_XDECREF(req);
        Py_XDECREF(named);
        Py_XDECREF(body);
        if (row == NULL || PyList_Append(rows, row) < 0) {
            Py_XDECREF(row);
            Py_DECREF(rows);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                Py_RETURN_NONE; /* protobuf says what such bytes are */
            }
            return NULL;
        }
        Py_DECREF(row);
        start = stop;
    }
    return rows;
}

static PyMethodDef methods[] = {
    {"split_runs", (PyCFunction)(void (*)(void))split_runs, METH_FASTCALL, "The store's rows of accepted events."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvguard.daemon._rows",
    .m_doc = "The audit store's rows of accepted events.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__rows(void)
{
    import_array();
    return PyModule_Create(&module);
}
