/* TLS records in bulk on an ssl.SSLObject, with the GIL released once per call.

   Python's _ssl releases the GIL around each SSL_read, and SSL_read yields at most one record
   (16 KiB of plaintext, RFC 8446 §5.1), so a thread decrypting a MiB takes the GIL back ~64
   times and, beside an event loop running Python, waits for it each time. Here one call feeds
   a ciphertext chunk to the object's incoming memory BIO and reads every record it completes
   into a caller's buffer, with the GIL released for all of it. OpenSSL is the one _ssl uses:
   its functions are looked up through _ssl's own shared object (dlsym searches its
   dependencies), so the two can never be different builds, and nothing here links OpenSSL.

   The SSL pointer is read from the _ssl._SSLSocket object behind SSLObject._sslobj, whose
   first fields (after the object header) are the socket weakref and the SSL pointer in
   CPython 3.8 to 3.13; bind() checks a candidate against what _ssl itself reports (protocol
   version string, the incoming BIO pointer of the ssl.MemoryBIO given) before it is used, and
   the caller falls back to SSLObject.read when it refuses. The caller must own the SSL
   object on one thread at a time, as OpenSSL requires. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *socket;
    void *ssl;
} SSLSocketHead; /* the leading fields of _ssl's PySSLSocket */

typedef struct {
    PyObject_HEAD
    void *bio;
} MemoryBIOHead; /* the leading field of _ssl's PySSLMemoryBIO */

#define SSL_ERROR_SSL 1
#define SSL_ERROR_WANT_READ 2
#define SSL_ERROR_WANT_WRITE 3
#define SSL_ERROR_SYSCALL 5
#define SSL_ERROR_ZERO_RETURN 6

static int (*p_SSL_read_ex)(void *, void *, size_t, size_t *);
static int (*p_SSL_get_error)(const void *, int);
static void *(*p_SSL_get_rbio)(const void *);
static const char *(*p_SSL_get_version)(const void *);
static int (*p_BIO_write)(void *, const void *, int);
static unsigned long (*p_ERR_get_error)(void);
static void (*p_ERR_error_string_n)(unsigned long, char *, size_t);
static void (*p_ERR_clear_error)(void);
static int loaded = 0; /* 1: every function found; -1: not */

static int load(void) {
    if (loaded) return loaded;
    loaded = -1;
    PyObject *module = PyImport_ImportModule("_ssl");
    if (module == NULL) return -1;
    PyObject *file = PyObject_GetAttrString(module, "__file__");
    Py_DECREF(module);
    if (file == NULL) return -1;
    const char *path = PyUnicode_AsUTF8(file);
    void *handle = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    Py_DECREF(file);
    if (handle == NULL) {
        PyErr_Clear();
        return -1;
    }
#define FIND(name) \
    if ((*(void **)&p_##name = dlsym(handle, #name)) == NULL) return -1;
    FIND(SSL_read_ex)
    FIND(SSL_get_error)
    FIND(SSL_get_rbio)
    FIND(SSL_get_version)
    FIND(BIO_write)
    FIND(ERR_get_error)
    FIND(ERR_error_string_n)
    FIND(ERR_clear_error)
#undef FIND
    loaded = 1;
    return 1;
}

static void *ssl_of(PyObject *sslobj) {
    /* the SSL pointer of an _ssl._SSLSocket (type checked by name: _ssl exports no type) */
    if (strcmp(Py_TYPE(sslobj)->tp_name, "_ssl._SSLSocket") != 0) {
        PyErr_SetString(PyExc_TypeError, "expected an _ssl._SSLSocket (SSLObject._sslobj)");
        return NULL;
    }
    return ((SSLSocketHead *)sslobj)->ssl;
}

PyDoc_STRVAR(bind_doc,
"bind(sslobj, incoming, version) -> bool\n\n"
"Whether bulk reads can run on ``sslobj`` (an SSLObject's ``_sslobj``): OpenSSL was found\n"
"through _ssl, and the SSL pointer read from it is the one whose incoming BIO is\n"
"``incoming`` (the ssl.MemoryBIO it was wrapped with) and whose version is ``version``\n"
"(what SSLObject.version() says).");

static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *sslobj, *incoming;
    const char *version;
    if (!PyArg_ParseTuple(args, "OOs:bind", &sslobj, &incoming, &version)) return NULL;
    if (load() != 1) Py_RETURN_FALSE;
    void *ssl = ssl_of(sslobj);
    if (ssl == NULL) return NULL;
    if (strcmp(Py_TYPE(incoming)->tp_name, "_ssl.MemoryBIO") != 0) {
        PyErr_SetString(PyExc_TypeError, "incoming must be an ssl.MemoryBIO");
        return NULL;
    }
    void *bio = ((MemoryBIOHead *)incoming)->bio;
    if (bio == NULL || p_SSL_get_rbio(ssl) != bio) Py_RETURN_FALSE;
    const char *ours = p_SSL_get_version(ssl);
    if (ours == NULL || strcmp(ours, version) != 0) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* read() statuses */
#define MORE 0   /* the buffer is full; the BIO may hold more */
#define NEED 1   /* every complete record was read: more ciphertext is needed */
#define CLOSED 2 /* the peer's close_notify was read */

PyDoc_STRVAR(read_doc,
"read(sslobj, incoming, data, out) -> (count, status)\n\n"
"Write ``data`` (ciphertext, may be empty) to the incoming BIO, then decrypt records into\n"
"``out`` until it is full (status 0), the BIO holds no complete record (1), or the peer's\n"
"close_notify is read (2); ``count`` bytes of ``out`` were filled. The GIL is released for\n"
"all of it. ``sslobj`` must have passed bind().\n\n"
"Raises:\n"
"    ssl.SSLError: a record that does not decrypt, an alert, a protocol error (the\n"
"        message is OpenSSL's).");

static PyObject *read_records(PyObject *self, PyObject *args) {
    PyObject *sslobj, *incoming;
    Py_buffer data, out;
    if (loaded != 1) {
        PyErr_SetString(PyExc_RuntimeError, "bind() first");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOy*w*:read", &sslobj, &incoming, &data, &out)) return NULL;
    void *ssl = ssl_of(sslobj);
    void *bio = ssl ? ((MemoryBIOHead *)incoming)->bio : NULL;
    if (ssl == NULL || bio == NULL || strcmp(Py_TYPE(incoming)->tp_name, "_ssl.MemoryBIO") != 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "incoming must be an ssl.MemoryBIO");
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return NULL;
    }
    size_t filled = 0, total = (size_t)out.len, got = 0;
    int status = NEED, error = 0, written_ok = 1;
    unsigned long code = 0;
    char message[256] = "";
    const char *in = (const char *)data.buf;
    Py_ssize_t left = data.len;
    Py_BEGIN_ALLOW_THREADS
    p_ERR_clear_error();
    while (left > 0) { /* BIO_write takes an int */
        int chunk = left > (1 << 30) ? (1 << 30) : (int)left;
        if (p_BIO_write(bio, in, chunk) != chunk) {
            written_ok = 0;
            break;
        }
        in += chunk;
        left -= chunk;
    }
    while (written_ok && filled < total) {
        if (p_SSL_read_ex(ssl, (char *)out.buf + filled, total - filled, &got)) {
            filled += got;
            continue;
        }
        int reason = p_SSL_get_error(ssl, 0);
        if (reason == SSL_ERROR_WANT_READ) break;
        if (reason == SSL_ERROR_ZERO_RETURN) {
            status = CLOSED;
            break;
        }
        error = reason;
        code = p_ERR_get_error();
        if (code) p_ERR_error_string_n(code, message, sizeof message);
        p_ERR_clear_error();
        break;
    }
    if (written_ok && !error && status == NEED && filled == total) status = MORE;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (!written_ok) return PyErr_NoMemory();
    if (error) {
        PyObject *ssl_module = PyImport_ImportModule("ssl");
        if (ssl_module == NULL) return NULL;
        PyObject *kind = PyObject_GetAttrString(ssl_module, "SSLError");
        Py_DECREF(ssl_module);
        if (kind == NULL) return NULL;
        if (!message[0])
            snprintf(message, sizeof message, "TLS record processing failed (SSL error %d)", error);
        PyObject *exc_args = Py_BuildValue("(is)", error, message);
        if (exc_args != NULL) {
            PyErr_SetObject(kind, exc_args);
            Py_DECREF(exc_args);
        }
        Py_DECREF(kind);
        return NULL;
    }
    return Py_BuildValue("(ni)", (Py_ssize_t)filled, status);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, bind_doc},
    {"read", read_records, METH_VARARGS, read_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moqt._tlsrecords",
    "TLS records decrypted in bulk with the GIL released (see moqt.qmux_tls).", -1, methods,
};

PyMODINIT_FUNC PyInit__tlsrecords(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "MORE", MORE) < 0 || PyModule_AddIntConstant(m, "NEED", NEED) < 0 ||
        PyModule_AddIntConstant(m, "CLOSED", CLOSED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
