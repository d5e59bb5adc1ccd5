/* Object headers of MOQT draft-16 data streams (§10.4.2 Figure 29, §10.4.4 Figure 31), read in C.
 *
 * A 2 MiB KV block fetched as 32 objects crosses 32 object headers, and on aioquic each costs
 * more Python work than the QUIC packet that carries it (bench/bench_moqt.py). These functions
 * read one whole header, its Extensions and the per-object extension rules of §11.2-11.4
 * included, in one call.
 *
 * They take only what they are sure of: a header that is whole and valid in every field. For
 * anything else (a header cut short by the end of the buffer, an End of Range marker, a status
 * object, an inherited field the stream has not set, any value the spec makes an error) they
 * return None, and moqt/objects.py reads the header in Python, which raises the exact error or
 * waits for more data. So the native path decides no error and no edge case; for every input it
 * takes, its result is the Python reader's (tests/moqt/test_objscan.py feeds both the same
 * streams, valid and corrupted, whole and byte by byte).
 *
 *   fetch_object(data, pos, prior) -> (end, group, subgroup, object, priority, extensions,
 *                                      payload_length) | None
 *   subgroup_object(data, pos, has_extensions, last) -> (end, object, extensions,
 *                                                        payload_length) | None
 *
 * ``prior`` and ``last`` are the parser's record of the previous object (attributes group_id,
 * subgroup_id, object_id, publisher_priority) or None; ``extensions`` is a tuple of
 * (type, value) pairs, value an int for even types and bytes for odd ones, as
 * moqt.wire.decode_kvp_block gives.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define VARINT_MAX ((UINT64_C(1) << 62) - 1)
#define MAX_EXTENSIONS_LENGTH (1 << 20) /* moqt.objects_wire.MAX_EXTENSIONS_LENGTH */
#define KVP_VALUE_MAX_LENGTH 0xFFFF

#define EXT_IMMUTABLE 0x0B
#define EXT_PRIOR_GROUP_ID_GAP 0x3C
#define EXT_PRIOR_OBJECT_ID_GAP 0x3E

#define FETCH_SUBGROUP_MASK 0x03
#define FETCH_SUBGROUP_PRIOR 0x01
#define FETCH_SUBGROUP_NEXT 0x02
#define FETCH_SUBGROUP_PRESENT 0x03
#define FETCH_OBJECT_ID 0x04
#define FETCH_GROUP_ID 0x08
#define FETCH_PRIORITY 0x10
#define FETCH_EXTENSIONS 0x20
#define FETCH_DATAGRAM 0x40

/* Results of the readers below: TAKEN, DECLINED (leave it to Python), or FAILED (a Python
 * exception is set: memory). */
#define TAKEN 1
#define DECLINED 0
#define FAILED (-1)

static PyObject *str_group_id, *str_subgroup_id, *str_object_id, *str_publisher_priority;

/* The varint at p[*pos] (§1.4.1); 0 when the buffer ends inside it. */
static int read_varint(const uint8_t *p, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out) {
    Py_ssize_t at = *pos;
    if (at >= end) {
        return 0;
    }
    int size = 1 << (p[at] >> 6);
    if (at + size > end) {
        return 0;
    }
    uint64_t value = p[at] & 0x3F;
    for (int i = 1; i < size; i++) {
        value = (value << 8) | p[at + i];
    }
    *pos = at + size;
    *out = value;
    return 1;
}

/* Walk a Key-Value-Pair block (§1.4.2) over p[start:end]. With ``pairs`` set, build the tuple of
 * (type, value) pairs; with ``seen_immutable`` set, report whether any pair is
 * IMMUTABLE_EXTENSIONS. DECLINED for anything decode_kvp_block would raise on. */
static int walk_kvps(const uint8_t *p, Py_ssize_t start, Py_ssize_t end, PyObject **pairs,
                     int *seen_immutable) {
    PyObject *list = NULL;
    if (pairs != NULL) {
        list = PyList_New(0);
        if (list == NULL) {
            return FAILED;
        }
    }
    Py_ssize_t pos = start;
    uint64_t previous = 0;
    while (pos < end) {
        uint64_t delta, value;
        if (!read_varint(p, end, &pos, &delta)) {
            goto declined;
        }
        if (delta > UINT64_MAX - previous) {
            goto declined; /* a Type above 2^64 - 1 */
        }
        uint64_t type = previous + delta;
        if (!read_varint(p, end, &pos, &value)) {
            goto declined;
        }
        PyObject *item = NULL;
        if (type & 1) {
            if (value > KVP_VALUE_MAX_LENGTH || (Py_ssize_t)value > end - pos) {
                goto declined;
            }
            if (list != NULL) {
                item = PyBytes_FromStringAndSize((const char *)p + pos, (Py_ssize_t)value);
            }
            pos += (Py_ssize_t)value;
        } else if (list != NULL) {
            item = PyLong_FromUnsignedLongLong(value);
        }
        if (type == EXT_IMMUTABLE && seen_immutable != NULL) {
            *seen_immutable = 1;
        }
        if (list != NULL) {
            if (item == NULL) {
                goto failed;
            }
            PyObject *key = PyLong_FromUnsignedLongLong(type);
            PyObject *pair = key == NULL ? NULL : PyTuple_Pack(2, key, item);
            Py_XDECREF(key);
            Py_DECREF(item);
            if (pair == NULL || PyList_Append(list, pair) < 0) {
                Py_XDECREF(pair);
                goto failed;
            }
            Py_DECREF(pair);
        }
        previous = type;
    }
    if (list != NULL) {
        *pairs = PyList_AsTuple(list);
        Py_DECREF(list);
        return *pairs == NULL ? FAILED : TAKEN;
    }
    return TAKEN;
declined:
    Py_XDECREF(list);
    return DECLINED;
failed:
    Py_XDECREF(list);
    return FAILED;
}

/* An Extensions structure (§10.2.1.2) at p[*pos], with the rules of
 * moqt.objects_wire.check_object_extensions: at most one each of IMMUTABLE_EXTENSIONS,
 * PRIOR_GROUP_ID_GAP and PRIOR_OBJECT_ID_GAP, and an IMMUTABLE_EXTENSIONS value that parses and
 * holds no other. */
static int read_extensions(const uint8_t *p, Py_ssize_t end, Py_ssize_t *pos, PyObject **out) {
    uint64_t length;
    if (!read_varint(p, end, pos, &length)) {
        return DECLINED;
    }
    if (length > MAX_EXTENSIONS_LENGTH || (Py_ssize_t)length > end - *pos) {
        return DECLINED;
    }
    Py_ssize_t start = *pos, stop = start + (Py_ssize_t)length;
    PyObject *pairs = NULL;
    int result = walk_kvps(p, start, stop, &pairs, NULL);
    if (result != TAKEN) {
        return result;
    }
    int immutable = 0, group_gap = 0, object_gap = 0;
    Py_ssize_t count = PyTuple_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        uint64_t type = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 0));
        int *seen = type == EXT_IMMUTABLE            ? &immutable
                    : type == EXT_PRIOR_GROUP_ID_GAP  ? &group_gap
                    : type == EXT_PRIOR_OBJECT_ID_GAP ? &object_gap
                                                      : NULL;
        if (seen == NULL) {
            continue;
        }
        if (*seen) {
            goto declined; /* a repeated extension: a malformed track */
        }
        *seen = 1;
        if (type == EXT_IMMUTABLE) {
            PyObject *value = PyTuple_GET_ITEM(pair, 1);
            const uint8_t *inner = (const uint8_t *)PyBytes_AS_STRING(value);
            int nested = 0;
            if (walk_kvps(inner, 0, PyBytes_GET_SIZE(value), NULL, &nested) != TAKEN || nested) {
                goto declined; /* unparsable, or nesting another: a malformed track */
            }
        }
    }
    *pos = stop;
    *out = pairs;
    return TAKEN;
declined:
    Py_DECREF(pairs);
    return DECLINED;
}

static int buffer_and_pos(PyObject *data, PyObject *pos_obj, Py_buffer *view, Py_ssize_t *pos) {
    *pos = PyLong_AsSsize_t(pos_obj);
    if (*pos == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (PyObject_GetBuffer(data, view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (*pos < 0 || *pos > view->len) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "position outside the buffer");
        return -1;
    }
    return 0;
}

/* An attribute of the prior object that is an int (not None) and below 2^62, as a C value. */
static int prior_int(PyObject *prior, PyObject *name, uint64_t *out, PyObject **as_object) {
    PyObject *value = PyObject_GetAttr(prior, name);
    if (value == NULL) {
        return FAILED;
    }
    if (value == Py_None || !PyLong_CheckExact(value)) {
        Py_DECREF(value);
        return DECLINED;
    }
    uint64_t number = PyLong_AsUnsignedLongLong(value);
    if (number == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(value);
        return DECLINED;
    }
    *out = number;
    if (as_object != NULL) {
        *as_object = value;
    } else {
        Py_DECREF(value);
    }
    return TAKEN;
}

static PyObject *fetch_object(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fetch_object(data, pos, prior)");
        return NULL;
    }
    Py_buffer view;
    Py_ssize_t pos;
    if (buffer_and_pos(args[0], args[1], &view, &pos) < 0) {
        return NULL;
    }
    PyObject *prior = args[2];
    const uint8_t *p = (const uint8_t *)view.buf;
    Py_ssize_t end = view.len;
    PyObject *group = NULL, *subgroup = NULL, *object = NULL, *priority = NULL;
    PyObject *extensions = NULL, *result = NULL;
    int status = DECLINED;
    uint64_t flags, value, number;

    if (!read_varint(p, end, &pos, &flags) || flags >= 128) {
        goto done; /* End of Range markers and invalid flags: Python's */
    }
    /* Group ID */
    if (flags & FETCH_GROUP_ID) {
        if (!read_varint(p, end, &pos, &value) || !(group = PyLong_FromUnsignedLongLong(value))) {
            goto error_or_short;
        }
    } else if (prior == Py_None) {
        goto done;
    } else if ((status = prior_int(prior, str_group_id, &number, &group)) != TAKEN) {
        goto done;
    }
    /* Subgroup ID */
    if (flags & FETCH_DATAGRAM) {
        subgroup = Py_NewRef(Py_None);
    } else {
        int mode = (int)(flags & FETCH_SUBGROUP_MASK);
        if (mode == FETCH_SUBGROUP_PRESENT) {
            if (!read_varint(p, end, &pos, &value) ||
                !(subgroup = PyLong_FromUnsignedLongLong(value))) {
                goto error_or_short;
            }
        } else if (mode == FETCH_SUBGROUP_PRIOR || mode == FETCH_SUBGROUP_NEXT) {
            if (prior == Py_None) {
                status = DECLINED;
                goto done;
            }
            if ((status = prior_int(prior, str_subgroup_id, &number, NULL)) != TAKEN) {
                goto done;
            }
            subgroup = PyLong_FromUnsignedLongLong(number + (mode == FETCH_SUBGROUP_NEXT));
            if (subgroup == NULL) {
                status = FAILED;
                goto done;
            }
        } else {
            subgroup = PyLong_FromLong(0);
            if (subgroup == NULL) {
                status = FAILED;
                goto done;
            }
        }
    }
    /* Object ID */
    if (flags & FETCH_OBJECT_ID) {
        if (!read_varint(p, end, &pos, &value) || !(object = PyLong_FromUnsignedLongLong(value))) {
            goto error_or_short;
        }
    } else {
        if (prior == Py_None) {
            status = DECLINED;
            goto done;
        }
        if ((status = prior_int(prior, str_object_id, &number, NULL)) != TAKEN) {
            goto done;
        }
        if (number + 1 > VARINT_MAX) {
            status = DECLINED;
            goto done;
        }
        if (!(object = PyLong_FromUnsignedLongLong(number + 1))) {
            status = FAILED;
            goto done;
        }
    }
    /* Publisher Priority */
    if (flags & FETCH_PRIORITY) {
        if (pos >= end) {
            status = DECLINED;
            goto done;
        }
        if (!(priority = PyLong_FromLong(p[pos++]))) {
            status = FAILED;
            goto done;
        }
    } else {
        if (prior == Py_None) {
            status = DECLINED;
            goto done;
        }
        if ((status = prior_int(prior, str_publisher_priority, &number, &priority)) != TAKEN) {
            goto done;
        }
    }
    /* Extensions */
    if (flags & FETCH_EXTENSIONS) {
        if ((status = read_extensions(p, end, &pos, &extensions)) != TAKEN) {
            goto done;
        }
    } else {
        extensions = PyTuple_New(0);
        if (extensions == NULL) {
            status = FAILED;
            goto done;
        }
    }
    /* Object Payload Length */
    if (!read_varint(p, end, &pos, &value)) {
        status = DECLINED;
        goto done;
    }
    result = Py_BuildValue("(nOOOOOK)", pos, group, subgroup, object, priority, extensions,
                           (unsigned long long)value);
    status = result == NULL ? FAILED : TAKEN;
    goto done;
error_or_short:
    status = PyErr_Occurred() ? FAILED : DECLINED;
done:
    Py_XDECREF(group);
    Py_XDECREF(subgroup);
    Py_XDECREF(object);
    Py_XDECREF(priority);
    Py_XDECREF(extensions);
    PyBuffer_Release(&view);
    if (status == FAILED) {
        Py_XDECREF(result);
        return NULL;
    }
    if (status == DECLINED) {
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *subgroup_object(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "subgroup_object(data, pos, has_extensions, last)");
        return NULL;
    }
    int has_extensions = PyObject_IsTrue(args[2]);
    if (has_extensions < 0) {
        return NULL;
    }
    Py_buffer view;
    Py_ssize_t pos;
    if (buffer_and_pos(args[0], args[1], &view, &pos) < 0) {
        return NULL;
    }
    PyObject *last = args[3];
    const uint8_t *p = (const uint8_t *)view.buf;
    Py_ssize_t end = view.len;
    PyObject *extensions = NULL, *result = NULL;
    int status = DECLINED;
    uint64_t delta, object, length, previous;

    if (!read_varint(p, end, &pos, &delta)) {
        goto done;
    }
    if (last == Py_None) {
        object = delta;
    } else {
        if ((status = prior_int(last, str_object_id, &previous, NULL)) != TAKEN) {
            goto done;
        }
        status = DECLINED;
        if (delta > VARINT_MAX || previous + delta + 1 > VARINT_MAX) {
            goto done;
        }
        object = previous + delta + 1;
    }
    if (has_extensions) {
        if ((status = read_extensions(p, end, &pos, &extensions)) != TAKEN) {
            goto done;
        }
        status = DECLINED;
    } else if (!(extensions = PyTuple_New(0))) {
        status = FAILED;
        goto done;
    }
    if (!read_varint(p, end, &pos, &length) || length == 0) {
        goto done; /* short, or a status object: Python's */
    }
    result = Py_BuildValue("(nKOK)", pos, (unsigned long long)object, extensions,
                           (unsigned long long)length);
    status = result == NULL ? FAILED : TAKEN;
done:
    Py_XDECREF(extensions);
    PyBuffer_Release(&view);
    if (status == FAILED) {
        return NULL;
    }
    if (status == DECLINED) {
        Py_RETURN_NONE;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"fetch_object", (PyCFunction)(void (*)(void))fetch_object, METH_FASTCALL,
     "fetch_object(data, pos, prior): a whole, valid FETCH stream object header, or None."},
    {"subgroup_object", (PyCFunction)(void (*)(void))subgroup_object, METH_FASTCALL,
     "subgroup_object(data, pos, has_extensions, last): a whole, valid subgroup object header "
     "with a payload, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "moqt._objscan",
    "Object headers of MOQT data streams read in C; None for all the Python reader must decide.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__objscan(void) {
    str_group_id = PyUnicode_InternFromString("group_id");
    str_subgroup_id = PyUnicode_InternFromString("subgroup_id");
    str_object_id = PyUnicode_InternFromString("object_id");
    str_publisher_priority = PyUnicode_InternFromString("publisher_priority");
    if (!str_group_id || !str_subgroup_id || !str_object_id || !str_publisher_priority) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
