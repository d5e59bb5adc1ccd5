/* Read-only byte slices, and objects, that Python's cyclic garbage collector does not walk
 * (the payloads a relay caches, MOQT draft-16 §8; relay/cache.py).
 *
 * A relay caches each object as a slice of the buffer it was received into. Held as a
 * memoryview, each such slice is two objects the collector tracks (the view and its managed
 * buffer), beside the cached object and its Location, and a full collection walks them all:
 * 256,000 cached 4 KiB objects (a 1 GiB cache of small layers) made each full collection take
 * about 100 ms of the event loop. Nothing cached can be part of a reference cycle, so here:
 *
 *   FrozenSlice(view) -> a read-only slice of the same octets as ``view`` (a C-contiguous
 *       buffer of single octets), which holds an export of the object at the bottom of
 *       ``view`` (the memoryview's own exporter: bytes, a bytearray, an mmap, a ctypes array)
 *       and is not tracked: it refers to nothing but that exporter, which refers to nothing
 *       of ours, so no cycle can pass through it. It exports its octets read-only, has a
 *       len(), and equals nothing but itself (compare bytes(...) for content).
 *
 *   untrack(obj) -> obj, taken off the collector's lists: only for an instance of a class
 *       defined in Python (whose deallocation untracks with the checked call, so a second
 *       untrack is harmless) or an exact tuple, and only when the caller knows that no
 *       reference cycle passes through it (relay.cache: cached objects and their Locations,
 *       whose fields are ints, bytes, tuples of those, enum members and FrozenSlices).
 *       Anything else is a TypeError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    Py_buffer base; /* an export of the exporter at the bottom of the view given */
    char *start;
    Py_ssize_t length;
} FrozenSlice;

static void frozen_dealloc(FrozenSlice *self) {
    PyBuffer_Release(&self->base);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *frozen_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *source;
    static char *keywords[] = {"view", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:FrozenSlice", keywords, &source)) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_FULL_RO) < 0) {
        return NULL;
    }
    if (view.itemsize != 1 || !PyBuffer_IsContiguous(&view, 'C')) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "FrozenSlice needs a C-contiguous buffer of octets");
        return NULL;
    }
    /* the exporter at the bottom: a memoryview's own (its managed buffer's) object, else
       what was given */
    PyObject *exporter = source;
    if (PyMemoryView_Check(source)) {
        exporter = PyMemoryView_GET_BUFFER(source)->obj;
        if (exporter == NULL) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "FrozenSlice needs a view of an object");
            return NULL;
        }
    }
    FrozenSlice *self = (FrozenSlice *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (PyObject_GetBuffer(exporter, &self->base, PyBUF_SIMPLE) < 0) {
        self->base.obj = NULL;
        PyBuffer_Release(&view);
        Py_DECREF(self);
        return NULL;
    }
    char *low = (char *)self->base.buf, *at = (char *)view.buf;
    if (view.len > 0 && (at < low || at + view.len > low + self->base.len)) {
        PyBuffer_Release(&view);
        Py_DECREF(self);
        PyErr_SetString(PyExc_ValueError, "the view's octets are not within its exporter's");
        return NULL;
    }
    self->start = view.len > 0 ? at : low;
    self->length = view.len;
    PyBuffer_Release(&view);
    return (PyObject *)self;
}

static int frozen_getbuffer(FrozenSlice *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->start, self->length, 1, flags);
}

static Py_ssize_t frozen_length(FrozenSlice *self) { return self->length; }

static PyObject *frozen_repr(FrozenSlice *self) {
    return PyUnicode_FromFormat("<FrozenSlice of %zd octets>", self->length);
}

static PyBufferProcs frozen_as_buffer = {(getbufferproc)frozen_getbuffer, NULL};

static PySequenceMethods frozen_as_sequence = {.sq_length = (lenfunc)frozen_length};

static PyTypeObject FrozenSliceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "moqt._frozen.FrozenSlice",
    .tp_basicsize = sizeof(FrozenSlice),
    .tp_dealloc = (destructor)frozen_dealloc,
    .tp_repr = (reprfunc)frozen_repr,
    .tp_as_sequence = &frozen_as_sequence,
    .tp_as_buffer = &frozen_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT, /* no Py_TPFLAGS_HAVE_GC: never tracked */
    .tp_doc = "A read-only slice of a buffer, holding its exporter; not tracked by the "
              "cyclic garbage collector.",
    .tp_new = frozen_new,
};

static PyObject *untrack(PyObject *module, PyObject *obj) {
    if (!(PyTuple_CheckExact(obj) || PyType_HasFeature(Py_TYPE(obj), Py_TPFLAGS_HEAPTYPE))) {
        PyErr_Format(PyExc_TypeError, "untrack takes an instance of a Python class or a tuple, "
                                      "not %.100s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (PyObject_IS_GC(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    Py_INCREF(obj);
    return obj;
}

static PyMethodDef methods[] = {
    {"untrack", untrack, METH_O,
     "Take ``obj`` (an instance of a Python class, or a tuple) off the cyclic collector's "
     "lists; the caller knows no reference cycle passes through it. Returns ``obj``."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "moqt._frozen",
    "Read-only byte slices and objects the cyclic garbage collector does not walk.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__frozen(void) {
    if (PyType_Ready(&FrozenSliceType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&FrozenSliceType);
    if (PyModule_AddObject(module, "FrozenSlice", (PyObject *)&FrozenSliceType) < 0) {
        Py_DECREF(&FrozenSliceType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
