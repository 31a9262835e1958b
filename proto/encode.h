/* The entry points of proto/encode.c, registered by proto/_wire.c. */
#ifndef KVGUARD_ENCODE_H
#define KVGUARD_ENCODE_H

#include <Python.h>

PyObject *kvg_encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvg_encode_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvg_encode_allocs(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *kvg_encode_pass(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
