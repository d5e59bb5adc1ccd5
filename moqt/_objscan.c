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
 *   fetch_objects(data, pos, prior) -> (end, [(group, subgroup, object, priority,
 *                                              extensions, payload_start, payload_length)...],
 *                                        payload_octets) | None
 *   subgroup_object(data, pos, has_extensions, last) -> (end, object, extensions,
 *                                                        payload_length) | None
 *
 * fetch_objects reads a run of whole objects, headers and payloads, that a piece of a FETCH
 * stream holds, so a block of small layers costs one call per piece, not one per object; it
 * takes an object only where fetch_object would, and one whose payload is wholly in the buffer.
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

/* What a FETCH object may inherit from the one before it (§10.4.4.1), as C values: a field the
 * prior lacks (None, no prior at all, or not a C-sized int) is not ``has_``. */
struct prior {
    int has_group, has_subgroup, has_object, has_priority;
    uint64_t group, subgroup, object, priority;
};

static int prior_field(PyObject *prior, PyObject *name, int *has, uint64_t *out) {
    *has = 0;
    if (prior == Py_None) {
        return 0;
    }
    int status = prior_int(prior, name, out, NULL);
    if (status == FAILED) {
        return -1;
    }
    *has = status == TAKEN;
    return 0;
}

static int read_prior(PyObject *prior, struct prior *out) {
    if (prior_field(prior, str_group_id, &out->has_group, &out->group) < 0 ||
        prior_field(prior, str_subgroup_id, &out->has_subgroup, &out->subgroup) < 0 ||
        prior_field(prior, str_object_id, &out->has_object, &out->object) < 0 ||
        prior_field(prior, str_publisher_priority, &out->has_priority, &out->priority) < 0) {
        return -1;
    }
    return 0;
}

/* One FETCH object header (§10.4.4, Figure 31) at p[*pos], its fields as C values. */
struct fetch_header {
    uint64_t group, subgroup, object, priority, length;
    int datagram;          /* no Subgroup ID (Datagram forwarding preference) */
    PyObject *extensions;  /* a new reference, once TAKEN */
};

static int read_fetch_header(const uint8_t *p, Py_ssize_t end, Py_ssize_t *pos,
                             const struct prior *prior, struct fetch_header *out) {
    uint64_t flags;
    Py_ssize_t at = *pos;
    if (!read_varint(p, end, &at, &flags) || flags >= 128) {
        return DECLINED; /* End of Range markers and invalid flags: Python's */
    }
    /* Group ID */
    if (flags & FETCH_GROUP_ID) {
        if (!read_varint(p, end, &at, &out->group)) {
            return DECLINED;
        }
    } else if (prior->has_group) {
        out->group = prior->group;
    } else {
        return DECLINED;
    }
    /* Subgroup ID */
    out->datagram = (flags & FETCH_DATAGRAM) != 0;
    out->subgroup = 0;
    if (!out->datagram) {
        int mode = (int)(flags & FETCH_SUBGROUP_MASK);
        if (mode == FETCH_SUBGROUP_PRESENT) {
            if (!read_varint(p, end, &at, &out->subgroup)) {
                return DECLINED;
            }
        } else if (mode == FETCH_SUBGROUP_PRIOR || mode == FETCH_SUBGROUP_NEXT) {
            if (!prior->has_subgroup) {
                return DECLINED;
            }
            out->subgroup = prior->subgroup + (mode == FETCH_SUBGROUP_NEXT);
        }
    }
    /* Object ID */
    if (flags & FETCH_OBJECT_ID) {
        if (!read_varint(p, end, &at, &out->object)) {
            return DECLINED;
        }
    } else {
        if (!prior->has_object || prior->object + 1 > VARINT_MAX) {
            return DECLINED;
        }
        out->object = prior->object + 1;
    }
    /* Publisher Priority */
    if (flags & FETCH_PRIORITY) {
        if (at >= end) {
            return DECLINED;
        }
        out->priority = p[at++];
    } else if (prior->has_priority) {
        out->priority = prior->priority;
    } else {
        return DECLINED;
    }
    /* Extensions */
    PyObject *extensions = NULL;
    if (flags & FETCH_EXTENSIONS) {
        int status = read_extensions(p, end, &at, &extensions);
        if (status != TAKEN) {
            return status;
        }
    }
    /* Object Payload Length */
    if (!read_varint(p, end, &at, &out->length)) {
        Py_XDECREF(extensions);
        return DECLINED;
    }
    if (extensions == NULL && !(extensions = PyTuple_New(0))) {
        return FAILED;
    }
    out->extensions = extensions;
    *pos = at;
    return TAKEN;
}

static PyObject *subgroup_value(const struct fetch_header *header) {
    return header->datagram ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(header->subgroup);
}

static PyObject *fetch_object(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fetch_object(data, pos, prior)");
        return NULL;
    }
    struct prior prior;
    if (read_prior(args[2], &prior) < 0) {
        return NULL;
    }
    Py_buffer view;
    Py_ssize_t pos;
    if (buffer_and_pos(args[0], args[1], &view, &pos) < 0) {
        return NULL;
    }
    struct fetch_header header;
    int status = read_fetch_header((const uint8_t *)view.buf, view.len, &pos, &prior, &header);
    PyBuffer_Release(&view);
    if (status == FAILED) {
        return NULL;
    }
    if (status == DECLINED) {
        Py_RETURN_NONE;
    }
    PyObject *subgroup = subgroup_value(&header);
    PyObject *result = subgroup == NULL ? NULL
                                        : Py_BuildValue("(nKOKKOK)", pos,
                                                        (unsigned long long)header.group, subgroup,
                                                        (unsigned long long)header.object,
                                                        (unsigned long long)header.priority,
                                                        header.extensions,
                                                        (unsigned long long)header.length);
    Py_XDECREF(subgroup);
    Py_DECREF(header.extensions);
    return result;
}

/* The whole FETCH objects (header and all of the payload) at data[pos:], one after another,
 * each inheriting from the one before as §10.4.4.1 says; it stops before the first object that
 * is not whole in the buffer or that fetch_object would decline. */
static PyObject *fetch_objects(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fetch_objects(data, pos, prior)");
        return NULL;
    }
    struct prior prior;
    if (read_prior(args[2], &prior) < 0) {
        return NULL;
    }
    Py_buffer view;
    Py_ssize_t pos;
    if (buffer_and_pos(args[0], args[1], &view, &pos) < 0) {
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)view.buf;
    Py_ssize_t end = view.len;
    unsigned long long octets = 0;
    PyObject *objects = PyList_New(0);
    if (objects == NULL) {
        goto failed;
    }
    while (pos < end) {
        struct fetch_header header;
        Py_ssize_t at = pos;
        int status = read_fetch_header(p, end, &at, &prior, &header);
        if (status == FAILED) {
            goto failed;
        }
        if (status == DECLINED) {
            break;
        }
        if (header.length > (uint64_t)(end - at)) {
            Py_DECREF(header.extensions);
            break; /* its payload goes on past this buffer: the parser's */
        }
        PyObject *subgroup = subgroup_value(&header);
        PyObject *item = subgroup == NULL ? NULL
                                          : Py_BuildValue("(KOKKOnn)",
                                                          (unsigned long long)header.group,
                                                          subgroup,
                                                          (unsigned long long)header.object,
                                                          (unsigned long long)header.priority,
                                                          header.extensions, at,
                                                          (Py_ssize_t)header.length);
        Py_XDECREF(subgroup);
        Py_DECREF(header.extensions);
        if (item == NULL || PyList_Append(objects, item) < 0) {
            Py_XDECREF(item);
            goto failed;
        }
        Py_DECREF(item);
        pos = at + (Py_ssize_t)header.length;
        octets += header.length;
        prior.has_group = prior.has_object = prior.has_priority = 1;
        prior.group = header.group;
        prior.object = header.object;
        prior.priority = header.priority;
        prior.has_subgroup = !header.datagram;
        prior.subgroup = header.subgroup;
    }
    PyBuffer_Release(&view);
    if (PyList_GET_SIZE(objects) == 0) {
        Py_DECREF(objects);
        Py_RETURN_NONE;
    }
    PyObject *result = Py_BuildValue("(nNK)", pos, objects, octets);
    return result;
failed:
    Py_XDECREF(objects);
    PyBuffer_Release(&view);
    return NULL;
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
    {"fetch_objects", (PyCFunction)(void (*)(void))fetch_objects, METH_FASTCALL,
     "fetch_objects(data, pos, prior): the whole, valid FETCH stream objects at pos, or None."},
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
