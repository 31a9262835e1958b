/* The check before attention over a batch, from the page tags alone
 * (kvguard.ledger._pages.check_tags; ledger/pages.py check_tags says what it answers, and
 * cuda_hooks/kernels.py is its GPU twin), and the whole check of a decode batch on the host
 * (batch_clean: the readers named and their states read here too). One pass over the block
 * tables: a row stops at its first page that fails and reads no entry beyond its context; no
 * temporary array.
 */
#include "pages.h"

/* A 1-d array of `type` (any stride: a column of the PAGE records is a strided view), or of
 * int32 when `type` is NPY_INT64 and `wide` is given (*wide then says which it is). */
static const char *
column(PyObject *o, int type, int *wide, npy_intp *n, npy_intp *stride, const char *what, const char *expected)
{
    int t = PyArray_Check(o) ? PyArray_TYPE((PyArrayObject *)o) : -1;
    if (t < 0 || PyArray_NDIM((PyArrayObject *)o) != 1 || (t != type && !(wide && t == NPY_INT32))) {
        PyErr_Format(PyExc_TypeError, "check_tags: %s must be a 1-d array of %s", what, expected);
        return NULL;
    }
    if (wide)
        *wide = t == NPY_INT64;
    *n = PyArray_DIM((PyArrayObject *)o, 0);
    *stride = PyArray_STRIDE((PyArrayObject *)o, 0);
    return PyArray_BYTES((PyArrayObject *)o);
}

/* Entry i of an int32 or int64 array's bytes. */
static inline int64_t
entry(const char *base, npy_intp stride, npy_intp i, int wide)
{
    const char *at = base + i * stride;
    return wide ? *(const int64_t *)at : (int64_t)*(const int32_t *)at;
}

/* A batch's block tables: row b's entry c is at base + b * row_stride + c * col_stride; the
 * page it names is the entry divided by `per` (1 for page ids; the page size for a table of
 * token slots read at each page's first slot, as SGLang's req_to_token). */
typedef struct {
    const char *base;
    npy_intp row_stride, col_stride, width;
    int wide;
    int64_t per;
} Table;

/* Whether every slot of row b's context (len > 0 tokens) holds reader's own KV, written under
 * its current grant: own == reader and valid >= the slots read, page by page, from entry
 * `first` on (the caller vouches for the entries before it). */
static inline int
row_clean(const Table *t, npy_intp b, int64_t len, int64_t reader, const char *own, npy_intp own_stride,
          const char *valid, npy_intp valid_stride, npy_intp n_pages, int64_t page_size, npy_intp first)
{
    if (reader == NOBODY || len > (int64_t)t->width * page_size) /* no reader; a table too short */
        return 0;
    int ok = 1;
    const char *row = t->base + b * t->row_stride;
    for (npy_intp c = first < 0 ? 0 : first; ok && len > (int64_t)c * page_size; c++) {
        int64_t need = len - (int64_t)c * page_size; /* slots read in this page */
        if (need > page_size)
            need = page_size;
        int64_t page = entry(row, t->col_stride, c, t->wide) / t->per;
        ok = page >= 0 && page < (int64_t)n_pages && (int64_t) * (const int32_t *)(own + page * own_stride) == reader &&
             (int64_t) * (const uint32_t *)(valid + page * valid_stride) >= need;
    }
    return ok;
}

/* check_tags(own: int32[N], valid: uint32[N], tables: int32|int64[B, P], lens: int32|int64[B],
 *            readers: int64[B], page_size) -> bool[B] */
PyObject *
kvg_check_tags(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6)
        return PyErr_Format(PyExc_TypeError, "check_tags() takes 6 arguments (%zd given)", nargs);
    npy_intp n_own, n_valid, own_stride, valid_stride, n_lens, lens_stride, n_readers, readers_stride;
    const char *own = column(args[0], NPY_INT32, NULL, &n_own, &own_stride, "own", "int32");
    const char *valid = own ? column(args[1], NPY_UINT32, NULL, &n_valid, &valid_stride, "valid", "uint32") : NULL;
    PyObject *tables = args[2];
    if (valid == NULL)
        return NULL;
    if (n_valid != n_own)
        return PyErr_Format(PyExc_ValueError, "check_tags: own and valid differ in length");
    if (!PyArray_Check(tables) || PyArray_NDIM((PyArrayObject *)tables) != 2 ||
        (PyArray_TYPE((PyArrayObject *)tables) != NPY_INT64 && PyArray_TYPE((PyArrayObject *)tables) != NPY_INT32))
        return PyErr_Format(PyExc_TypeError, "check_tags: tables must be a 2-d array of int32 or int64");
    int wide_tables = PyArray_TYPE((PyArrayObject *)tables) == NPY_INT64, wide_lens;
    const char *lens = column(args[3], NPY_INT64, &wide_lens, &n_lens, &lens_stride, "lens", "int32 or int64");
    const char *readers =
        lens ? column(args[4], NPY_INT64, NULL, &n_readers, &readers_stride, "readers", "int64") : NULL;
    if (readers == NULL)
        return NULL;
    long long page_size = PyLong_AsLongLong(args[5]);
    if (page_size == -1 && PyErr_Occurred())
        return NULL;
    npy_intp batch = PyArray_DIM((PyArrayObject *)tables, 0), width = PyArray_DIM((PyArrayObject *)tables, 1);
    if (page_size <= 0 || n_lens != batch || n_readers != batch)
        return PyErr_Format(PyExc_ValueError, "check_tags: a batch of %zd tables, %zd lens, %zd readers, pages of %lld",
                            (Py_ssize_t)batch, (Py_ssize_t)n_lens, (Py_ssize_t)n_readers, page_size);
    const char *table_base = PyArray_BYTES((PyArrayObject *)tables);
    npy_intp row_stride = PyArray_STRIDE((PyArrayObject *)tables, 0), col_stride = PyArray_STRIDE((PyArrayObject *)tables, 1);
    npy_intp dims[1] = {batch};
    PyObject *out = PyArray_ZEROS(1, dims, NPY_BOOL, 0);
    if (out == NULL)
        return NULL;
    npy_bool *clean = PyArray_DATA((PyArrayObject *)out);
    Table t = {table_base, row_stride, col_stride, width, wide_tables, 1};
    for (npy_intp b = 0; b < batch; b++) {
        int64_t len = entry(lens, lens_stride, b, wide_lens);
        int64_t reader = entry(readers, readers_stride, b, 1);
        clean[b] = (npy_bool)(len == 0 || row_clean(&t, b, len, reader, own, own_stride, valid, valid_stride,
                                                    n_own, page_size, 0));
    }
    return out;
}

/* The reader of row b (req_index: name -> index into a req_table of n_reqs; NOBODY for a name
 * not there), or -1 with an exception. */
static inline long
reader_of(PyObject *reqs, PyObject *index, npy_intp b, npy_intp n_reqs)
{
    PyObject *found = PyDict_GetItemWithError(index, PyList_GET_ITEM(reqs, b));
    if (found == NULL)
        return PyErr_Occurred() ? -1 : NOBODY;
    long reader = PyLong_AsLong(found);
    if (reader == -1 && PyErr_Occurred())
        return -1;
    return reader < NOBODY || reader >= n_reqs ? NOBODY : reader;
}

/* The arguments both batch checks share, parsed: NULL with an exception. */
typedef struct {
    const Page *state;
    const Req *req_table;
    npy_intp n_pages, n_reqs, batch;
    PyObject *reqs, *index;
    const char *lens;
    npy_intp lens_stride;
    int wide_lens;
    long long page_size;
    Table t;
} Batch;

static int
parse_batch(Batch *b, PyObject *const *args, const char *fn, int indirect)
{
    npy_intp n_lens;
    b->state = kvg_records(args[0], kvg_page_descr, &b->n_pages, "state", "PAGE");
    b->req_table = b->state ? kvg_records(args[5], kvg_req_descr, &b->n_reqs, "req_table", "REQ") : NULL;
    if (b->req_table == NULL)
        return 0;
    PyObject *tables = args[1];
    b->reqs = args[3];
    b->index = args[4];
    if (!PyArray_Check(tables) || PyArray_NDIM((PyArrayObject *)tables) != 2 ||
        (PyArray_TYPE((PyArrayObject *)tables) != NPY_INT64 && PyArray_TYPE((PyArrayObject *)tables) != NPY_INT32)) {
        PyErr_Format(PyExc_TypeError, "%s: tables must be a 2-d array of int32 or int64", fn);
        return 0;
    }
    if (!PyList_Check(b->reqs) || !PyDict_Check(b->index)) {
        PyErr_Format(PyExc_TypeError, "%s: reqs must be a list, req_index a dict", fn);
        return 0;
    }
    b->lens = column(args[2], NPY_INT64, &b->wide_lens, &n_lens, &b->lens_stride, "lens", "int32 or int64");
    if (b->lens == NULL)
        return 0;
    b->page_size = PyLong_AsLongLong(args[6]);
    if (b->page_size == -1 && PyErr_Occurred())
        return 0;
    b->batch = n_lens;
    npy_intp n_tables = PyArray_DIM((PyArrayObject *)tables, 0);
    if (b->page_size <= 0 || (!indirect && n_tables != b->batch) || PyList_GET_SIZE(b->reqs) != b->batch) {
        PyErr_Format(PyExc_ValueError, "%s: a batch of %zd tables, %zd lens, %zd requests, pages of %lld", fn,
                     (Py_ssize_t)n_tables, (Py_ssize_t)n_lens, PyList_GET_SIZE(b->reqs), b->page_size);
        return 0;
    }
    Table t = {PyArray_BYTES((PyArrayObject *)tables), PyArray_STRIDE((PyArrayObject *)tables, 0),
               PyArray_STRIDE((PyArrayObject *)tables, 1), PyArray_DIM((PyArrayObject *)tables, 1),
               PyArray_TYPE((PyArrayObject *)tables) == NPY_INT64, 1};
    b->t = t;
    return 1;
}

/* What the incremental check reads each row past and records (batch_clean_from's arrays). */
typedef struct {
    const char *stable, *rows;
    npy_intp stable_stride, rows_stride;
    int64_t *upto, *by;
} Verify;

/* The check of every row of a batch (v NULL: whole rows; else each row past what was
 * verified before, recording what it verifies now): a new bool[B], NULL with an exception. */
static PyObject *
check_batch(const Batch *b, const Verify *v)
{
    npy_intp dims[1] = {b->batch};
    PyObject *out = PyArray_ZEROS(1, dims, NPY_BOOL, 0);
    if (out == NULL)
        return NULL;
    npy_bool *clean = PyArray_DATA((PyArrayObject *)out);
    const char *own = (const char *)&b->state->own, *valid = (const char *)&b->state->valid;
    for (npy_intp i = 0; i < b->batch; i++) {
        int64_t len = entry(b->lens, b->lens_stride, i, b->wide_lens);
        if (len == 0) { /* reads nothing */
            clean[i] = 1;
            continue;
        }
        long reader = reader_of(b->reqs, b->index, i, b->n_reqs);
        if (reader < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (reader == NOBODY)
            continue;
        if (b->req_table[reader].state >= ENDED) { /* rejected, aborted or killed: not clean */
            if (v != NULL)
                v->upto[reader] = 0;
            continue;
        }
        npy_intp at = i;
        int64_t from = 0;
        if (v != NULL) {
            at = v->rows != NULL ? (npy_intp)entry(v->rows, v->rows_stride, i, 1) : i;
            from = entry(v->stable, v->stable_stride, i, 1);
            if (from > v->upto[reader])
                from = v->upto[reader];
            if (from < 0)
                from = 0;
        }
        clean[i] = (npy_bool)row_clean(&b->t, at, len, reader, own, sizeof(Page), valid, sizeof(Page), b->n_pages,
                                       b->page_size, (npy_intp)from);
        if (v == NULL)
            continue;
        if (!clean[i]) {
            v->upto[reader] = 0;
            continue;
        }
        int64_t full = len / b->page_size;
        if (full > (int64_t)b->t.width)
            full = (int64_t)b->t.width;
        const char *row = b->t.base + at * b->t.row_stride;
        for (int64_t c = from; c < full; c++) {
            int64_t page = entry(row, b->t.col_stride, (npy_intp)c, b->t.wide) / b->t.per;
            if (page >= 0 && page < b->n_pages)
                v->by[page] = reader;
        }
        v->upto[reader] = full;
    }
    return out;
}

/* batch_clean(state: PAGE[N], tables: int32|int64[B, P], lens: int32|int64[B], reqs: list[str],
 *             req_index: dict, req_table: REQ[M], page_size) -> bool[B]
 * check_tags with the readers found here (req_index: name -> index into req_table; a name not
 * there reads as NOBODY) and, for each, its state: a request that was rejected, aborted or
 * killed is not clean, whatever its pages hold; one that reads nothing is. */
PyObject *
kvg_batch_clean(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7)
        return PyErr_Format(PyExc_TypeError, "batch_clean() takes 7 arguments (%zd given)", nargs);
    Batch b;
    if (!parse_batch(&b, args, "batch_clean", 0))
        return NULL;
    return check_batch(&b, NULL);
}

/* A writable, contiguous 1-d int64 array's data and length; NULL with an exception. */
static int64_t *
int64s(PyObject *o, npy_intp *n, const char *what)
{
    if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != NPY_INT64 || PyArray_NDIM((PyArrayObject *)o) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) || !PyArray_ISWRITEABLE((PyArrayObject *)o)) {
        PyErr_Format(PyExc_TypeError, "batch_clean_from: %s must be a writable, contiguous 1-d array of int64", what);
        return NULL;
    }
    *n = PyArray_DIM((PyArrayObject *)o, 0);
    return (int64_t *)PyArray_DATA((PyArrayObject *)o);
}

/* batch_clean_from(state, tables, lens, reqs, req_index, req_table, page_size,
 *                  stable: int64[B], upto: int64[M], by: int64[N], touched: int64[T],
 *                  rows: int64[B] | None, per: int) -> bool[B]
 * batch_clean's answer, reading each row only past what was verified before (agents/guard/
 * attention.py `Progress` keeps upto and by; this is their one writer):
 * - every page an event named since the last check (touched) is no longer vouched for: the
 *   reader that verified it (by[page]) starts over (upto = 0);
 * - row b is checked from entry min(upto[reader], stable[b]) on (stable: the leading entries
 *   the engine vouches are unchanged since that request's last check);
 * - a clean row's full pages up to its context are verified: by[page] = reader for the new
 *   ones, upto[reader] = their count; a row that is not clean starts over.
 * With `rows`, batch row b's table is tables[rows[b]] (the engine's own array, not gathered);
 * each entry names page entry / per (per > 1: a table of token slots, a column a page). */
PyObject *
kvg_batch_clean_from(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 13)
        return PyErr_Format(PyExc_TypeError, "batch_clean_from() takes 13 arguments (%zd given)", nargs);
    Batch b;
    int indirect = args[11] != Py_None;
    if (!parse_batch(&b, args, "batch_clean_from", indirect))
        return NULL;
    b.t.per = PyLong_AsLongLong(args[12]);
    if (b.t.per == -1 && PyErr_Occurred())
        return NULL;
    if (b.t.per <= 0)
        return PyErr_Format(PyExc_ValueError, "batch_clean_from: per must be positive, not %lld", (long long)b.t.per);
    Verify v = {NULL, NULL, 0, 0, NULL, NULL};
    npy_intp n_rows = 0, n_tables = PyArray_DIM((PyArrayObject *)args[1], 0);
    if (indirect) {
        v.rows = column(args[11], NPY_INT64, NULL, &n_rows, &v.rows_stride, "rows", "int64");
        if (v.rows == NULL)
            return NULL;
        if (n_rows != b.batch)
            return PyErr_Format(PyExc_ValueError, "batch_clean_from: %zd rows for a batch of %zd", (Py_ssize_t)n_rows,
                                (Py_ssize_t)b.batch);
        for (npy_intp i = 0; i < n_rows; i++) {
            int64_t r = entry(v.rows, v.rows_stride, i, 1);
            if (r < 0 || r >= n_tables)
                return PyErr_Format(PyExc_ValueError, "batch_clean_from: row %lld of a batch is not one of the %zd tables",
                                    (long long)r, (Py_ssize_t)n_tables);
        }
    }
    npy_intp n_stable, n_upto, n_by, n_touched, touched_stride;
    v.stable = column(args[7], NPY_INT64, NULL, &n_stable, &v.stable_stride, "stable", "int64");
    v.upto = v.stable ? int64s(args[8], &n_upto, "upto") : NULL;
    v.by = v.upto ? int64s(args[9], &n_by, "by") : NULL;
    const char *touched = v.by ? column(args[10], NPY_INT64, NULL, &n_touched, &touched_stride, "touched", "int64") : NULL;
    if (touched == NULL)
        return NULL;
    if (n_stable != b.batch || n_upto < b.n_reqs || n_by != b.n_pages)
        return PyErr_Format(PyExc_ValueError,
                            "batch_clean_from: %zd stable for %zd rows, %zd upto for %zd requests, %zd by for %zd pages",
                            (Py_ssize_t)n_stable, (Py_ssize_t)b.batch, (Py_ssize_t)n_upto, (Py_ssize_t)b.n_reqs,
                            (Py_ssize_t)n_by, (Py_ssize_t)b.n_pages);
    for (npy_intp k = 0; k < n_touched; k++) {
        int64_t page = entry(touched, touched_stride, k, 1);
        if (page >= 0 && page < b.n_pages && v.by[page] > NOBODY && v.by[page] < n_upto)
            v.upto[v.by[page]] = 0;
    }
    return check_batch(&b, &v);
}
