/* QMux's TLS 1.3 records (RFC 8446 §5): read in bulk through an ssl.SSLObject with the GIL
   released once per call, or, after the handshake, protected here (Records, further down).

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
#include <stdint.h>
#include <stdlib.h>
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
/* the record protection of an established session (Records) */
typedef void (*keylog_cb)(const void *, const char *);
static void *(*p_SSL_get_SSL_CTX)(const void *);
static void (*p_SSL_CTX_set_keylog_callback)(void *, keylog_cb);
static keylog_cb (*p_SSL_CTX_get_keylog_callback)(const void *);
static size_t (*p_SSL_CTX_get_num_tickets)(const void *);
static int (*p_CRYPTO_get_ex_new_index)(int, long, void *, void *, void *, void *);
static int (*p_SSL_set_ex_data)(void *, int, void *);
static void *(*p_SSL_get_ex_data)(const void *, int);
static const void *(*p_SSL_get_current_cipher)(const void *);
static unsigned long (*p_SSL_CIPHER_get_id)(const void *);
static int (*p_SSL_version)(const void *);
static int (*p_SSL_has_pending)(const void *);
static int (*p_SSL_set_ciphersuites)(void *, const char *);
static void *(*p_EVP_CIPHER_CTX_new)(void);
static void (*p_EVP_CIPHER_CTX_free)(void *);
static const void *(*p_EVP_aes_128_gcm)(void);
static const void *(*p_EVP_aes_256_gcm)(void);
static const void *(*p_EVP_chacha20_poly1305)(void);
static int (*p_EVP_CipherInit_ex)(void *, const void *, void *, const unsigned char *,
                                  const unsigned char *, int);
static int (*p_EVP_CipherUpdate)(void *, unsigned char *, int *, const unsigned char *, int);
static int (*p_EVP_CipherFinal_ex)(void *, unsigned char *, int *);
static int (*p_EVP_CIPHER_CTX_ctrl)(void *, int, int, void *);
static unsigned char *(*p_HMAC)(const void *, const void *, int, const unsigned char *, size_t,
                                unsigned char *, unsigned int *);
static const void *(*p_EVP_sha256)(void);
static const void *(*p_EVP_sha384)(void);
static void (*p_OPENSSL_cleanse)(void *, size_t);
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
    FIND(SSL_get_SSL_CTX)
    FIND(SSL_CTX_set_keylog_callback)
    FIND(SSL_CTX_get_keylog_callback)
    FIND(SSL_CTX_get_num_tickets)
    FIND(CRYPTO_get_ex_new_index)
    FIND(SSL_set_ex_data)
    FIND(SSL_get_ex_data)
    FIND(SSL_get_current_cipher)
    FIND(SSL_CIPHER_get_id)
    FIND(SSL_version)
    FIND(SSL_has_pending)
    FIND(SSL_set_ciphersuites)
    FIND(EVP_CIPHER_CTX_new)
    FIND(EVP_CIPHER_CTX_free)
    FIND(EVP_aes_128_gcm)
    FIND(EVP_aes_256_gcm)
    FIND(EVP_chacha20_poly1305)
    FIND(EVP_CipherInit_ex)
    FIND(EVP_CipherUpdate)
    FIND(EVP_CipherFinal_ex)
    FIND(EVP_CIPHER_CTX_ctrl)
    FIND(HMAC)
    FIND(EVP_sha256)
    FIND(EVP_sha384)
    FIND(OPENSSL_cleanse)
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

static PyObject *ssl_error(int code, const char *message) {
    /* raise ssl.SSLError(code, message); NULL */
    PyObject *ssl_module = PyImport_ImportModule("ssl");
    if (ssl_module == NULL) return NULL;
    PyObject *kind = PyObject_GetAttrString(ssl_module, "SSLError");
    Py_DECREF(ssl_module);
    if (kind == NULL) return NULL;
    PyObject *exc_args = Py_BuildValue("(is)", code, message);
    if (exc_args != NULL) {
        PyErr_SetObject(kind, exc_args);
        Py_DECREF(exc_args);
    }
    Py_DECREF(kind);
    return NULL;
}

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
        if (!message[0])
            snprintf(message, sizeof message, "TLS record processing failed (SSL error %d)", error);
        return ssl_error(error, message);
    }
    return Py_BuildValue("(ni)", (Py_ssize_t)filled, status);
}


/* --- TLS 1.3 record protection of an established session (RFC 8446 §5.2-5.5, §7.1-7.2) ---

   OpenSSL runs the handshake; then Records protects and opens the application records itself,
   as kernel TLS does after a user-space handshake: ciphertext is decrypted from the socket read
   straight into the receive buffer, and plaintext is encrypted from the caller's buffers
   straight into the bytes that go to the socket. Through SSLObject's memory BIOs every byte
   was copied three more times on each side (into the incoming BIO, into OpenSSL's record
   buffer, out to the caller; into the outgoing BIO as it grows, out of it as bytes). The
   traffic secrets come from OpenSSL's key log callback (the one SSLKEYLOGFILE uses), which
   capture() installs on the SSL_CTX before the handshake, keeping them with the SSL object
   until Records takes and wipes them. Post-handshake messages are handled as RFC 8446 §4.6
   says: NewSessionTicket is ignored (no resumption), KeyUpdate updates the reading keys and,
   when the peer asks, our next sealed bytes carry our own KeyUpdate; our writing keys are
   also updated before 2^24 records (§5.5). An alert other than close_notify or
   user_canceled, a record that does not authenticate, and any other violation raise
   ssl.SSLError; the connection is then closed without an alert (as when OpenSSL fails). */

#define TLS13_VERSION 0x0304
#define SUITE_AES_128_GCM 0x03001301UL
#define SUITE_AES_256_GCM 0x03001302UL
#define SUITE_CHACHA20_POLY1305 0x03001303UL
#define TAG_LEN 16
#define IV_LEN 12
#define HEADER_LEN 5
#define MAX_PLAIN 16384                    /* 2^14 octets of plaintext a record (§5.1) */
#define MAX_CIPHER (MAX_PLAIN + 256)       /* §5.2 */
#define MAX_RECORD (HEADER_LEN + MAX_CIPHER)
#define HANDSHAKE_MAX 65536                /* post-handshake message octets held at most */
#define CT_ALERT 21
#define CT_HANDSHAKE 22
#define CT_APPLICATION_DATA 23
#define HS_NEW_SESSION_TICKET 4
#define HS_KEY_UPDATE 24
#define ALERT_CLOSE_NOTIFY 0
#define ALERT_USER_CANCELED 90
#define EVP_CTRL_AEAD_GET_TAG 0x10
#define EVP_CTRL_AEAD_SET_TAG 0x11
#define REKEY_AFTER (1ULL << 24) /* §5.5: at most 2^24.5 full records under one AES-GCM key */
#define APP_OVERHEAD (HEADER_LEN + 1 + TAG_LEN)
#define KEY_UPDATE_RECORD (HEADER_LEN + 5 + 1 + TAG_LEN)

typedef struct {
    unsigned char client[64], server[64];
    size_t client_len, server_len;
} Captured; /* CLIENT_/SERVER_TRAFFIC_SECRET_0, as the key log gave them */

static int ex_index = -1;

static void free_captured(void *parent, void *ptr, void *ad, int idx, long argl, void *argp) {
    (void)parent, (void)ad, (void)idx, (void)argl, (void)argp;
    if (ptr != NULL) {
        p_OPENSSL_cleanse(ptr, sizeof(Captured));
        free(ptr);
    }
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void on_keylog(const void *ssl, const char *line) {
    /* "CLIENT_TRAFFIC_SECRET_0 <client random> <secret>", in hex (the NSS key log format) */
    static const char client_label[] = "CLIENT_TRAFFIC_SECRET_0 ";
    static const char server_label[] = "SERVER_TRAFFIC_SECRET_0 ";
    int client;
    if (strncmp(line, client_label, sizeof client_label - 1) == 0)
        client = 1;
    else if (strncmp(line, server_label, sizeof server_label - 1) == 0)
        client = 0;
    else
        return;
    const char *hex = strchr(line + sizeof client_label - 1, ' ');
    if (hex == NULL) return;
    hex++;
    Captured *captured = p_SSL_get_ex_data(ssl, ex_index);
    if (captured == NULL) {
        captured = calloc(1, sizeof *captured);
        if (captured == NULL) return;
        if (!p_SSL_set_ex_data((void *)ssl, ex_index, captured)) {
            free(captured);
            return;
        }
    }
    unsigned char *secret = client ? captured->client : captured->server;
    size_t n = 0;
    while (n < sizeof captured->client && hex[2 * n] && hex[2 * n + 1]) {
        int high = hex_value(hex[2 * n]), low = hex_value(hex[2 * n + 1]);
        if (high < 0 || low < 0) break;
        secret[n++] = (unsigned char)(high << 4 | low);
    }
    *(client ? &captured->client_len : &captured->server_len) = n;
}

PyDoc_STRVAR(capture_doc,
"capture(sslobj) -> bool\n\n"
"Keep the traffic secrets of ``sslobj`` (an SSLObject's ``_sslobj``, before its handshake)\n"
"for Records: installs this module's key log callback on its SSL_CTX, which serves every\n"
"connection of that context. False where OpenSSL was not found, or the context logs keys\n"
"elsewhere already (SSLContext.keylog_filename, e.g. from SSLKEYLOGFILE).");

static PyObject *capture(PyObject *self, PyObject *arg) {
    if (load() != 1) Py_RETURN_FALSE;
    void *ssl = ssl_of(arg);
    if (ssl == NULL) return NULL;
    if (ex_index < 0) {
        ex_index = p_CRYPTO_get_ex_new_index(0 /* CRYPTO_EX_INDEX_SSL */, 0, NULL, NULL, NULL,
                                             (void *)free_captured);
        if (ex_index < 0) Py_RETURN_FALSE;
    }
    void *ctx = p_SSL_get_SSL_CTX(ssl);
    keylog_cb current = p_SSL_CTX_get_keylog_callback(ctx);
    if (current != NULL && current != on_keylog) Py_RETURN_FALSE;
    p_SSL_CTX_set_keylog_callback(ctx, on_keylog);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(ciphersuites_doc,
"ciphersuites(sslobj, suites) -> bool\n\n"
"Set the TLS 1.3 cipher suites ``sslobj`` offers or accepts, in order of preference (an\n"
"OpenSSL list such as \"TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384\"), before its\n"
"handshake; ssl.SSLContext.set_ciphers reaches only TLS 1.2 and earlier. False where OpenSSL\n"
"was not found or refuses the list.");

static PyObject *ciphersuites(PyObject *self, PyObject *args) {
    PyObject *sslobj;
    const char *suites;
    if (!PyArg_ParseTuple(args, "Os:ciphersuites", &sslobj, &suites)) return NULL;
    if (load() != 1) Py_RETURN_FALSE;
    void *ssl = ssl_of(sslobj);
    if (ssl == NULL) return NULL;
    if (p_SSL_set_ciphersuites(ssl, suites) != 1) {
        p_ERR_clear_error();
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

typedef struct {
    unsigned char secret[64], key[32], iv[IV_LEN];
    uint64_t seq;
    void *ctx; /* EVP_CIPHER_CTX, keyed */
} Direction;

typedef struct {
    PyObject_HEAD
    const void *cipher, *md;
    size_t key_len, hash_len;
    Direction in, out;
    uint64_t rekey_after;
    int server_side, closed, sent_close, respond, busy;
    unsigned char *carry; /* a record split between reads (MAX_RECORD octets, lazily) */
    size_t carry_len;
    unsigned char *handshake; /* post-handshake messages (HANDSHAKE_MAX octets, lazily) */
    size_t handshake_len;
} Records;

static int expand_label(const Records *r, const unsigned char *secret, const char *label,
                        unsigned char *out, size_t length) {
    /* HKDF-Expand-Label(secret, label, "", length) for length <= Hash.length (§7.1):
       T(1) = HMAC(secret, HkdfLabel || 0x01) */
    unsigned char info[2 + 1 + 6 + 32 + 1 + 1], t[64];
    size_t n = 0, label_len = strlen(label);
    unsigned int t_len = 0;
    info[n++] = (unsigned char)(length >> 8);
    info[n++] = (unsigned char)length;
    info[n++] = (unsigned char)(6 + label_len);
    memcpy(info + n, "tls13 ", 6);
    n += 6;
    memcpy(info + n, label, label_len);
    n += label_len;
    info[n++] = 0; /* empty context */
    info[n++] = 1; /* the block counter */
    if (p_HMAC(r->md, secret, (int)r->hash_len, info, n, t, &t_len) == NULL || t_len < length)
        return 0;
    memcpy(out, t, length);
    p_OPENSSL_cleanse(t, sizeof t);
    return 1;
}

static int set_secret(Records *r, Direction *d, const unsigned char *secret, int encrypt) {
    if (secret != d->secret) memcpy(d->secret, secret, r->hash_len);
    if (!expand_label(r, d->secret, "key", d->key, r->key_len) ||
        !expand_label(r, d->secret, "iv", d->iv, IV_LEN))
        return 0;
    d->seq = 0;
    return p_EVP_CipherInit_ex(d->ctx, r->cipher, NULL, d->key, NULL, encrypt) == 1;
}

static int update_secret(Records *r, Direction *d, int encrypt) {
    /* application_traffic_secret_N+1 (§7.2) */
    unsigned char next[64];
    if (!expand_label(r, d->secret, "traffic upd", next, r->hash_len)) return 0;
    memcpy(d->secret, next, r->hash_len);
    p_OPENSSL_cleanse(next, sizeof next);
    return set_secret(r, d, d->secret, encrypt);
}

static void nonce_of(const Direction *d, unsigned char *nonce) {
    memcpy(nonce, d->iv, IV_LEN);
    for (int i = 0; i < 8; i++) nonce[IV_LEN - 1 - i] ^= (unsigned char)(d->seq >> (8 * i));
}

/* error kinds, with the alert RFC 8446 §6.2 names for each */
#define E_NONE 0
#define E_BAD_RECORD_MAC 1
#define E_RECORD_OVERFLOW 2
#define E_UNEXPECTED_MESSAGE 3
#define E_DECODE_ERROR 4
#define E_ILLEGAL_PARAMETER 5
#define E_ALERT 6
#define E_NO_MEMORY 7
#define E_CRYPTO 8

static int open_record(Records *r, const unsigned char *record, size_t length,
                       unsigned char *out, size_t *plain) {
    /* decrypt and authenticate one record of ``length`` ciphertext octets into ``out`` */
    unsigned char nonce[IV_LEN];
    int n = 0, last = 0;
    void *ctx = r->in.ctx;
    size_t body = length - TAG_LEN;
    nonce_of(&r->in, nonce);
    if (p_EVP_CipherInit_ex(ctx, NULL, NULL, NULL, nonce, 0) != 1 ||
        p_EVP_CipherUpdate(ctx, NULL, &n, record, HEADER_LEN) != 1 ||
        p_EVP_CipherUpdate(ctx, out, &n, record + HEADER_LEN, (int)body) != 1 ||
        p_EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, TAG_LEN,
                              (void *)(record + HEADER_LEN + body)) != 1)
        return E_CRYPTO;
    if (p_EVP_CipherFinal_ex(ctx, out + n, &last) != 1) return E_BAD_RECORD_MAC;
    r->in.seq++;
    *plain = body;
    return E_NONE;
}

static int take_handshake(Records *r, const unsigned char *data, size_t length) {
    /* post-handshake messages (§4.6) */
    if (r->handshake == NULL && (r->handshake = malloc(HANDSHAKE_MAX)) == NULL) return E_NO_MEMORY;
    if (length > HANDSHAKE_MAX - r->handshake_len) return E_UNEXPECTED_MESSAGE;
    memcpy(r->handshake + r->handshake_len, data, length);
    r->handshake_len += length;
    while (r->handshake_len >= 4) {
        unsigned char *m = r->handshake;
        size_t size = (size_t)m[1] << 16 | (size_t)m[2] << 8 | m[3];
        if (size > HANDSHAKE_MAX - 4) return E_UNEXPECTED_MESSAGE;
        if (r->handshake_len < 4 + size) break;
        if (m[0] == HS_NEW_SESSION_TICKET && !r->server_side) {
            /* no resumption here: the ticket is not kept */
        } else if (m[0] == HS_KEY_UPDATE) {
            if (size != 1) return E_DECODE_ERROR;
            if (m[4] > 1) return E_ILLEGAL_PARAMETER;
            if (r->handshake_len != 5) return E_UNEXPECTED_MESSAGE; /* must end its record */
            if (!update_secret(r, &r->in, 0)) return E_CRYPTO;
            if (m[4] == 1) r->respond = 1;
        } else {
            return E_UNEXPECTED_MESSAGE;
        }
        r->handshake_len -= 4 + size;
        memmove(m, m + 4 + size, r->handshake_len);
    }
    return E_NONE;
}

/* open() statuses, as read()'s */
PyDoc_STRVAR(open_doc,
"open(data, out) -> (taken, count, status)\n\n"
"Decrypt the records in ``data`` (ciphertext from the socket) into ``out``: ``taken`` octets\n"
"of ``data`` were used (a record's tail that a later read completes is kept here), ``count``\n"
"octets of plaintext were written at the start of ``out``. ``status``: MORE (``out`` has no\n"
"room for the next record: call again with ``data[taken:]`` and more room), NEED (all of\n"
"``data`` was used) or CLOSED (the peer's close_notify; what follows it is ignored). The\n"
"GIL is released meanwhile.\n\n"
"Raises:\n"
"    ssl.SSLError: a record that does not authenticate, an alert, a malformed record or\n"
"        message; nothing may be read after it.");

static int in_use(const Records *r) {
    /* another thread is in open() or seal() (the GIL is released there): set the error */
    if (!r->busy) return 0;
    PyErr_SetString(PyExc_RuntimeError, "Records is in use by another thread");
    return 1;
}

static PyObject *Records_open(Records *r, PyObject *args) {
    Py_buffer data, out;
    if (!PyArg_ParseTuple(args, "y*w*:open", &data, &out)) return NULL;
    if (in_use(r)) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (r->closed) { /* after close_notify nothing more is read */
        Py_ssize_t all = data.len;
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return Py_BuildValue("(nni)", all, (Py_ssize_t)0, CLOSED);
    }
    r->busy = 1;
    const unsigned char *in = data.buf;
    unsigned char *dst = out.buf;
    size_t avail = (size_t)data.len, pos = 0, room = (size_t)out.len, filled = 0;
    int status = NEED, error = E_NONE, alert = 0;
    Py_BEGIN_ALLOW_THREADS
    while (error == E_NONE) {
        const unsigned char *record = NULL;
        size_t length = 0;
        int carried = 0;
        if (r->carry_len == 0) {
            if (pos == avail) break; /* all used */
            if (avail - pos >= HEADER_LEN) {
                length = (size_t)in[pos + 3] << 8 | in[pos + 4];
                if (length > MAX_CIPHER) {
                    error = E_RECORD_OVERFLOW;
                    break;
                }
                if (avail - pos >= HEADER_LEN + length) record = in + pos; /* whole: in place */
            }
        }
        if (record == NULL) { /* the record is split between reads: gather it in the carry */
            if (r->carry == NULL && (r->carry = malloc(MAX_RECORD)) == NULL) {
                error = E_NO_MEMORY;
                break;
            }
            if (r->carry_len < HEADER_LEN) {
                size_t take = HEADER_LEN - r->carry_len;
                if (take > avail - pos) take = avail - pos;
                memcpy(r->carry + r->carry_len, in + pos, take);
                r->carry_len += take;
                pos += take;
                if (r->carry_len < HEADER_LEN) break;
            }
            length = (size_t)r->carry[3] << 8 | r->carry[4];
            if (length > MAX_CIPHER) {
                error = E_RECORD_OVERFLOW;
                break;
            }
            size_t take = HEADER_LEN + length - r->carry_len;
            if (take > avail - pos) take = avail - pos;
            memcpy(r->carry + r->carry_len, in + pos, take);
            r->carry_len += take;
            pos += take;
            if (r->carry_len < HEADER_LEN + length) break; /* the rest comes with a later read */
            record = r->carry;
            carried = 1;
        }
        if (record[0] != CT_APPLICATION_DATA) { /* §5: every protected record says 23 */
            error = E_UNEXPECTED_MESSAGE;
            break;
        }
        if (length < TAG_LEN + 1) {
            error = E_DECODE_ERROR;
            break;
        }
        if (room - filled < length - TAG_LEN) { /* no room: the record waits (here or in data) */
            status = MORE;
            break;
        }
        size_t plain = 0;
        unsigned char *target = dst + filled;
        if ((error = open_record(r, record, length, target, &plain)) != E_NONE) break;
        if (carried)
            r->carry_len = 0;
        else
            pos += HEADER_LEN + length;
        if (plain > MAX_PLAIN + 1) { /* TLSInnerPlaintext: 2^14 + 1 octets at most (§5.4) */
            error = E_RECORD_OVERFLOW;
            break;
        }
        while (plain > 0 && target[plain - 1] == 0) plain--; /* the padding (§5.4) */
        if (plain == 0) {
            error = E_UNEXPECTED_MESSAGE; /* no content type */
            break;
        }
        unsigned char type = target[--plain];
        if (plain > MAX_PLAIN) {
            error = E_RECORD_OVERFLOW;
            break;
        }
        if (r->handshake_len > 0 && type != CT_HANDSHAKE) {
            /* a handshake message split over records has nothing else between them (§5.1) */
            error = E_UNEXPECTED_MESSAGE;
            break;
        }
        if (type == CT_APPLICATION_DATA) {
            filled += plain;
        } else if (type == CT_ALERT) {
            if (plain != 2) {
                error = E_DECODE_ERROR;
                break;
            }
            if (target[1] == ALERT_CLOSE_NOTIFY) {
                r->closed = 1;
                status = CLOSED;
                pos = avail; /* nothing after it is read */
                break;
            }
            if (target[1] != ALERT_USER_CANCELED) {
                error = E_ALERT;
                alert = target[1];
            }
        } else if (type == CT_HANDSHAKE && plain > 0) {
            error = take_handshake(r, target, plain);
        } else {
            error = E_UNEXPECTED_MESSAGE;
        }
    }
    Py_END_ALLOW_THREADS
    r->busy = 0;
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (error != E_NONE) {
        r->closed = 1; /* nothing more can be read on this connection */
        static const char *const messages[] = {
            "", "bad record mac", "record overflow", "unexpected message", "decode error",
            "illegal parameter", "", "out of memory", "record protection failed"};
        char message[96];
        if (error == E_ALERT)
            snprintf(message, sizeof message, "the peer sent TLS alert %d", alert);
        else
            snprintf(message, sizeof message, "%s (TLS 1.3 record)", messages[error]);
        return ssl_error(SSL_ERROR_SSL, message);
    }
    if (status == NEED && pos < avail) status = MORE;
    return Py_BuildValue("(nni)", (Py_ssize_t)pos, (Py_ssize_t)filled, status);
}

static int seal_record(Records *r, unsigned char *dst, unsigned char type, Py_buffer *parts,
                       Py_ssize_t count, Py_ssize_t *part, size_t *offset, size_t plain,
                       const unsigned char *inline_data) {
    /* one record of ``plain`` octets, from ``inline_data`` or from parts[*part][*offset:]
       onwards; returns the octets written at ``dst`` (0: failed) */
    Direction *d = &r->out;
    void *ctx = d->ctx;
    unsigned char nonce[IV_LEN];
    size_t length = plain + 1 + TAG_LEN;
    int n = 0;
    dst[0] = CT_APPLICATION_DATA;
    dst[1] = 3;
    dst[2] = 3;
    dst[3] = (unsigned char)(length >> 8);
    dst[4] = (unsigned char)length;
    nonce_of(d, nonce);
    if (p_EVP_CipherInit_ex(ctx, NULL, NULL, NULL, nonce, 1) != 1 ||
        p_EVP_CipherUpdate(ctx, NULL, &n, dst, HEADER_LEN) != 1)
        return 0;
    unsigned char *at = dst + HEADER_LEN;
    if (inline_data != NULL) {
        if (p_EVP_CipherUpdate(ctx, at, &n, inline_data, (int)plain) != 1) return 0;
        at += n;
    } else {
        size_t left = plain;
        while (left > 0) {
            Py_buffer *b = &parts[*part];
            size_t here = (size_t)b->len - *offset;
            if (here == 0) {
                (*part)++;
                *offset = 0;
                continue;
            }
            if (here > left) here = left;
            if (p_EVP_CipherUpdate(ctx, at, &n, (const unsigned char *)b->buf + *offset,
                                   (int)here) != 1)
                return 0;
            at += n;
            *offset += here;
            left -= here;
        }
    }
    if (p_EVP_CipherUpdate(ctx, at, &n, &type, 1) != 1) return 0;
    at += n;
    if (p_EVP_CipherFinal_ex(ctx, at, &n) != 1) return 0;
    at += n;
    if (p_EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, TAG_LEN, at) != 1) return 0;
    d->seq++;
    return (int)(at + TAG_LEN - dst);
}

static size_t key_update(Records *r, unsigned char *dst) {
    /* our KeyUpdate(update_not_requested) under the current keys, then the next keys */
    static const unsigned char message[5] = {HS_KEY_UPDATE, 0, 0, 1, 0};
    Py_ssize_t part = 0;
    size_t offset = 0, n = (size_t)seal_record(r, dst, CT_HANDSHAKE, NULL, 0, &part, &offset,
                                               sizeof message, message);
    if (n == 0 || !update_secret(r, &r->out, 1)) return 0;
    r->respond = 0;
    return n;
}

static PyObject *sealed(Records *r, Py_buffer *parts, Py_ssize_t count, size_t total,
                        unsigned char type) {
    size_t records = (total + MAX_PLAIN - 1) / MAX_PLAIN;
    if (total == 0 && type != CT_APPLICATION_DATA) records = 1;
    size_t bound = total + records * APP_OVERHEAD + (records + 1) * KEY_UPDATE_RECORD;
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
    if (result == NULL) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(result), *at = dst;
    int failed = 0;
    r->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t part = 0;
    size_t offset = 0, left = total;
    static const unsigned char close_notify[2] = {1, ALERT_CLOSE_NOTIFY};
    do {
        if (r->respond || r->out.seq >= r->rekey_after) {
            size_t n = key_update(r, at);
            if (n == 0) {
                failed = 1;
                break;
            }
            at += n;
        }
        if (type == CT_ALERT) {
            size_t n = (size_t)seal_record(r, at, CT_ALERT, NULL, 0, &part, &offset,
                                           sizeof close_notify, close_notify);
            if (n == 0) failed = 1;
            at += n;
            break;
        }
        if (left == 0) break;
        size_t plain = left < MAX_PLAIN ? left : MAX_PLAIN;
        size_t n = (size_t)seal_record(r, at, CT_APPLICATION_DATA, parts, count, &part, &offset,
                                       plain, NULL);
        if (n == 0) {
            failed = 1;
            break;
        }
        at += n;
        left -= plain;
    } while (left > 0);
    Py_END_ALLOW_THREADS
    r->busy = 0;
    if (failed) {
        Py_DECREF(result);
        r->sent_close = 1; /* the write keys may be out of step: nothing more is sent */
        PyErr_SetString(PyExc_RuntimeError, "TLS record protection failed");
        return NULL;
    }
    if (_PyBytes_Resize(&result, (Py_ssize_t)(at - dst)) < 0) return NULL;
    return result;
}

PyDoc_STRVAR(seal_doc,
"seal(buffers) -> bytes\n\n"
"The records that carry ``buffers`` (a sequence of bytes-like objects, in order; records of\n"
"2^14 octets span them), preceded by our KeyUpdate when the peer asked for one or the keys\n"
"have protected 2^24 records. The GIL is released while encrypting: the buffers must not\n"
"change until it returns.");

static PyObject *Records_seal(Records *r, PyObject *arg) {
    if (in_use(r)) return NULL;
    if (r->sent_close) {
        PyErr_SetString(PyExc_ValueError, "close_notify was sent: nothing more can be");
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(arg, "seal() takes a sequence of buffers");
    if (sequence == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence), got = 0;
    Py_buffer *parts = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    size_t total = 0;
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < count; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, got), &parts[got],
                               PyBUF_SIMPLE) < 0)
            goto done;
        total += (size_t)parts[got].len;
    }
    if (total == 0 && !r->respond) {
        result = PyBytes_FromStringAndSize(NULL, 0);
        goto done;
    }
    result = sealed(r, parts, count, total, CT_APPLICATION_DATA);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&parts[i]);
    PyMem_Free(parts);
    Py_DECREF(sequence);
    return result;
}

PyDoc_STRVAR(close_notify_doc,
"close_notify() -> bytes\n\n"
"Our close_notify alert (RFC 8446 §6.1), after which seal() refuses.");

static PyObject *Records_close_notify(Records *r, PyObject *unused) {
    if (in_use(r)) return NULL;
    if (r->sent_close) return PyBytes_FromStringAndSize(NULL, 0);
    PyObject *result = sealed(r, NULL, 0, 0, CT_ALERT);
    r->sent_close = 1;
    return result;
}

static PyObject *Records_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"sslobj", "server_side", "rekey_after", NULL};
    PyObject *sslobj;
    int server_side;
    unsigned long long rekey_after = REKEY_AFTER;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Op|K:Records", keywords, &sslobj,
                                     &server_side, &rekey_after))
        return NULL;
    if (load() != 1 || ex_index < 0) {
        PyErr_SetString(PyExc_ValueError, "no secrets: capture() was not called or failed");
        return NULL;
    }
    void *ssl = ssl_of(sslobj);
    if (ssl == NULL) return NULL;
    const char *refusal = NULL;
    unsigned long suite = 0;
    const void *cipher = p_SSL_get_current_cipher(ssl);
    Captured *captured = p_SSL_get_ex_data(ssl, ex_index);
    if (p_SSL_version(ssl) != TLS13_VERSION)
        refusal = "not TLS 1.3";
    else if (cipher == NULL)
        refusal = "no cipher suite agreed (the handshake is not done)";
    else if (captured == NULL)
        refusal = "no traffic secrets were logged for this connection";
    else if (p_SSL_has_pending(ssl))
        refusal = "OpenSSL holds unread record octets";
    else if (server_side && p_SSL_CTX_get_num_tickets(p_SSL_get_SSL_CTX(ssl)) != 0)
        refusal = "a server that sends session tickets (SSLContext.num_tickets is not 0)";
    if (refusal == NULL) {
        suite = p_SSL_CIPHER_get_id(cipher);
        if (suite != SUITE_AES_128_GCM && suite != SUITE_AES_256_GCM &&
            suite != SUITE_CHACHA20_POLY1305)
            refusal = "an unknown cipher suite";
    }
    if (refusal != NULL) {
        PyErr_Format(PyExc_ValueError, "TLS records stay with OpenSSL: %s", refusal);
        return NULL;
    }
    Records *r = (Records *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->server_side = server_side;
    r->rekey_after = rekey_after ? rekey_after : 1;
    r->hash_len = suite == SUITE_AES_256_GCM ? 48 : 32;
    r->md = suite == SUITE_AES_256_GCM ? p_EVP_sha384() : p_EVP_sha256();
    r->key_len = suite == SUITE_AES_128_GCM ? 16 : 32;
    r->cipher = suite == SUITE_AES_128_GCM   ? p_EVP_aes_128_gcm()
                : suite == SUITE_AES_256_GCM ? p_EVP_aes_256_gcm()
                                             : p_EVP_chacha20_poly1305();
    r->in.ctx = p_EVP_CIPHER_CTX_new();
    r->out.ctx = p_EVP_CIPHER_CTX_new();
    const unsigned char *reading = server_side ? captured->client : captured->server;
    const unsigned char *writing = server_side ? captured->server : captured->client;
    size_t reading_len = server_side ? captured->client_len : captured->server_len;
    size_t writing_len = server_side ? captured->server_len : captured->client_len;
    int ok = r->in.ctx != NULL && r->out.ctx != NULL && reading_len == r->hash_len &&
             writing_len == r->hash_len && set_secret(r, &r->in, reading, 0) &&
             set_secret(r, &r->out, writing, 1);
    p_SSL_set_ex_data(ssl, ex_index, NULL); /* the secrets are ours now: wiped there */
    free_captured(NULL, captured, NULL, 0, 0, NULL);
    if (!ok) {
        p_ERR_clear_error();
        Py_DECREF(r);
        PyErr_SetString(PyExc_ValueError, "TLS records stay with OpenSSL: the keys failed");
        return NULL;
    }
    return (PyObject *)r;
}

static void Records_dealloc(Records *r) {
    if (loaded == 1) {
        if (r->in.ctx) p_EVP_CIPHER_CTX_free(r->in.ctx);
        if (r->out.ctx) p_EVP_CIPHER_CTX_free(r->out.ctx);
        p_OPENSSL_cleanse(&r->in, sizeof r->in);
        p_OPENSSL_cleanse(&r->out, sizeof r->out);
    }
    free(r->carry);
    free(r->handshake);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Records_key_updates_due(Records *r, void *closure) {
    return PyBool_FromLong(r->respond);
}

static PyObject *Records_sequence(Records *r, void *closure) {
    return Py_BuildValue("(KK)", (unsigned long long)r->in.seq, (unsigned long long)r->out.seq);
}

static PyMethodDef Records_methods[] = {
    {"open", (PyCFunction)Records_open, METH_VARARGS, open_doc},
    {"seal", (PyCFunction)Records_seal, METH_O, seal_doc},
    {"close_notify", (PyCFunction)Records_close_notify, METH_NOARGS, close_notify_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Records_getset[] = {
    {"respond", (getter)Records_key_updates_due, NULL,
     "Whether the peer asked for a KeyUpdate that our next sealed bytes will carry.", NULL},
    {"sequence", (getter)Records_sequence, NULL,
     "(records opened, records sealed) under the current keys of each direction.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Records_doc,
"Records(sslobj, server_side, rekey_after=2**24)\n\n"
"The TLS 1.3 record protection of ``sslobj`` (an SSLObject's ``_sslobj``), taken over from\n"
"OpenSSL once its handshake is done, with the traffic secrets capture() kept: open() and\n"
"seal() then carry every record, and the SSL object must not read or write any more.\n"
"``rekey_after``: records sealed under one key before our KeyUpdate (tests make it small).\n\n"
"Raises:\n"
"    ValueError: the records must stay with OpenSSL (not TLS 1.3, no secrets, OpenSSL holds\n"
"        unread records, a server that sends session tickets, an unknown cipher suite).");

static PyTypeObject RecordsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "moqt._tlsrecords.Records",
    .tp_basicsize = sizeof(Records),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Records_doc,
    .tp_new = Records_new,
    .tp_dealloc = (destructor)Records_dealloc,
    .tp_methods = Records_methods,
    .tp_getset = Records_getset,
};

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, bind_doc},
    {"read", read_records, METH_VARARGS, read_doc},
    {"capture", capture, METH_O, capture_doc},
    {"ciphersuites", ciphersuites, METH_VARARGS, ciphersuites_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moqt._tlsrecords",
    "QMux's TLS 1.3 records: decrypted in bulk off the GIL through OpenSSL's SSL object, or\n"
    "protected by Records once the handshake is done (see moqt.qmux_tls).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__tlsrecords(void) {
    if (PyType_Ready(&RecordsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RecordsType);
    if (PyModule_AddObject(m, "Records", (PyObject *)&RecordsType) < 0) {
        Py_DECREF(&RecordsType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MORE", MORE) < 0 || PyModule_AddIntConstant(m, "NEED", NEED) < 0 ||
        PyModule_AddIntConstant(m, "CLOSED", CLOSED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
