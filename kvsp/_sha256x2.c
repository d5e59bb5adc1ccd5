/* Two SHA-256 streams over the same octets, interleaved on the x86 SHA extensions.
 *
 * Spec §6.7 makes a client hash every octet of a block twice: once for Repr-Digest (the whole
 * container) and once for the layer digests of the Replica Record. The two messages are
 * independent, so their compression rounds can be issued together: SHA256RNDS2 has a latency of
 * several cycles but a throughput of one per one or two, and a single stream leaves the unit
 * idle between dependent rounds. Interleaving two streams fills those gaps, so both digests
 * cost little more than one (bench/bench_blocks.py measures it against hashlib).
 *
 * The module offers ``Sha256`` (a streaming SHA-256 whose ``update`` releases the GIL) and
 * ``update2(a, b, data)``, which feeds the same octets to two such objects in one pass, and
 * ``digests(data, size)``, which hashes consecutive runs of one size (a FETCH's layers) two at a
 * time, each octet once.
 * ``accelerated`` says whether this CPU has the SHA extensions; without them every call raises
 * RuntimeError and callers use hashlib (kvsp.sha256x2 says which). Results are FIPS 180-4 SHA-256,
 * checked against hashlib by tests/test_sha256x2.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define KVSP_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define KVSP_X86 0
#endif

#define RELEASE_GIL_AT 4096 /* octets: below this, releasing the GIL costs more than it frees */

static const uint32_t INITIAL[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static int accelerated = 0;

typedef struct {
    uint32_t h[8];
    uint64_t length; /* octets fed so far */
    uint8_t pending[64];
    size_t fill;     /* octets in pending */
} State;

#if KVSP_X86
static const uint32_t K[64] __attribute__((aligned(16))) = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define TARGET __attribute__((target("sha,sse4.1,ssse3")))

/* The state as the SHA instructions hold it: (ABEF, CDGH). */
TARGET static inline void load_state(const uint32_t h[8], __m128i *abef, __m128i *cdgh) {
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    *abef = _mm_alignr_epi8(cdab, efgh, 8);
    *cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

TARGET static inline void store_state(uint32_t h[8], __m128i abef, __m128i cdgh) {
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

/* Message words t..t+3 of group g >= 4 from the four groups before it. */
#define SCHEDULE(w, g)                                                                   \
    _mm_sha256msg2_epu32(                                                                \
        _mm_add_epi32(_mm_sha256msg1_epu32(w[((g) - 4) & 3], w[((g) - 3) & 3]),          \
                      _mm_alignr_epi8(w[((g) - 1) & 3], w[((g) - 2) & 3], 4)),           \
        w[((g) - 1) & 3])

/* Four rounds: two SHA256RNDS2, the second on the upper half of the round inputs. */
#define ROUNDS4(abef, cdgh, wk)                                                          \
    do {                                                                                 \
        cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);                                    \
        abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));           \
    } while (0)

static inline __m128i byteswap_mask(void) {
    return _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
}

/* Compress n 64-octet blocks of one stream. */
TARGET static void compress1(uint32_t h[8], const uint8_t *p, size_t n) {
    const __m128i mask = byteswap_mask();
    __m128i abef, cdgh;
    load_state(h, &abef, &cdgh);
    for (; n > 0; n--, p += 64) {
        __m128i save_abef = abef, save_cdgh = cdgh, w[4];
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            if (g < 4)
                w[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), mask);
            else
                w[g & 3] = SCHEDULE(w, g);
            __m128i wk = _mm_add_epi32(w[g & 3], _mm_load_si128((const __m128i *)&K[4 * g]));
            ROUNDS4(abef, cdgh, wk);
        }
        abef = _mm_add_epi32(abef, save_abef);
        cdgh = _mm_add_epi32(cdgh, save_cdgh);
    }
    store_state(h, abef, cdgh);
}

/* Compress n blocks of each of two streams, their rounds interleaved. */
TARGET static void compress2(uint32_t ha[8], const uint8_t *pa, uint32_t hb[8],
                             const uint8_t *pb, size_t n) {
    const __m128i mask = byteswap_mask();
    __m128i a_abef, a_cdgh, b_abef, b_cdgh;
    load_state(ha, &a_abef, &a_cdgh);
    load_state(hb, &b_abef, &b_cdgh);
    for (; n > 0; n--, pa += 64, pb += 64) {
        __m128i a_save_abef = a_abef, a_save_cdgh = a_cdgh;
        __m128i b_save_abef = b_abef, b_save_cdgh = b_cdgh;
        __m128i wa[4], wb[4];
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            if (g < 4) {
                wa[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(pa + 16 * g)), mask);
                wb[g] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(pb + 16 * g)), mask);
            } else {
                wa[g & 3] = SCHEDULE(wa, g);
                wb[g & 3] = SCHEDULE(wb, g);
            }
            __m128i k = _mm_load_si128((const __m128i *)&K[4 * g]);
            __m128i wka = _mm_add_epi32(wa[g & 3], k);
            __m128i wkb = _mm_add_epi32(wb[g & 3], k);
            a_cdgh = _mm_sha256rnds2_epu32(a_cdgh, a_abef, wka);
            b_cdgh = _mm_sha256rnds2_epu32(b_cdgh, b_abef, wkb);
            a_abef = _mm_sha256rnds2_epu32(a_abef, a_cdgh, _mm_shuffle_epi32(wka, 0x0E));
            b_abef = _mm_sha256rnds2_epu32(b_abef, b_cdgh, _mm_shuffle_epi32(wkb, 0x0E));
        }
        a_abef = _mm_add_epi32(a_abef, a_save_abef);
        a_cdgh = _mm_add_epi32(a_cdgh, a_save_cdgh);
        b_abef = _mm_add_epi32(b_abef, b_save_abef);
        b_cdgh = _mm_add_epi32(b_cdgh, b_save_cdgh);
    }
    store_state(ha, a_abef, a_cdgh);
    store_state(hb, b_abef, b_cdgh);
}

static int cpu_has_sha(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (!(c & bit_SSSE3) || !(c & bit_SSE4_1))
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b & (1u << 29)) != 0; /* CPUID.(EAX=7,ECX=0):EBX.SHA[bit 29] */
}
#else
static void compress1(uint32_t h[8], const uint8_t *p, size_t n) {
    (void)h, (void)p, (void)n;
}
static void compress2(uint32_t ha[8], const uint8_t *pa, uint32_t hb[8], const uint8_t *pb,
                      size_t n) {
    (void)ha, (void)pa, (void)hb, (void)pb, (void)n;
}
static int cpu_has_sha(void) { return 0; }
#endif

/* Feed up to what completes the pending block; returns the octets taken. */
static size_t top_up(State *s, const uint8_t *p, size_t n) {
    if (s->fill == 0)
        return 0;
    size_t take = 64 - s->fill;
    if (take > n)
        take = n;
    memcpy(s->pending + s->fill, p, take);
    s->fill += take;
    s->length += take;
    if (s->fill == 64) {
        compress1(s->h, s->pending, 1);
        s->fill = 0;
    }
    return take;
}

static void keep_tail(State *s, const uint8_t *p, size_t n) {
    memcpy(s->pending, p, n);
    s->fill = n;
    s->length += n;
}

static void feed1(State *s, const uint8_t *p, size_t n) {
    size_t taken = top_up(s, p, n);
    p += taken, n -= taken;
    if (s->fill != 0)
        return; /* everything went into the pending block */
    size_t blocks = n / 64;
    compress1(s->h, p, blocks);
    s->length += blocks * 64;
    keep_tail(s, p + blocks * 64, n - blocks * 64);
}

static void feed2(State *a, State *b, const uint8_t *p, size_t n) {
    size_t ta = top_up(a, p, n), tb = top_up(b, p, n);
    if (a->fill != 0 || b->fill != 0) { /* one took it all: the other goes alone */
        if (a->fill == 0)
            feed1(a, p + ta, n - ta);
        if (b->fill == 0)
            feed1(b, p + tb, n - tb);
        return;
    }
    const uint8_t *pa = p + ta, *pb = p + tb;
    size_t na = n - ta, nb = n - tb;
    size_t common = (na < nb ? na : nb) / 64;
    compress2(a->h, pa, b->h, pb, common);
    a->length += common * 64, b->length += common * 64;
    feed1(a, pa + common * 64, na - common * 64);
    feed1(b, pb + common * 64, nb - common * 64);
}

static void finish(const State *s, uint8_t out[32]) {
    State t = *s;
    uint8_t tail[128] = {0};
    size_t n = t.fill;
    memcpy(tail, t.pending, n);
    tail[n] = 0x80;
    size_t total = n + 1 + 8 <= 64 ? 64 : 128;
    uint64_t bits = t.length * 8;
    for (int i = 0; i < 8; i++)
        tail[total - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress1(t.h, tail, total / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(t.h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(t.h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(t.h[i] >> 8);
        out[4 * i + 3] = (uint8_t)t.h[i];
    }
}

/* -- the Python face ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD State state;
    int busy; /* set, under the GIL, while a call works on the state without it */
} Sha256Object;

static PyTypeObject Sha256Type;

static int require_accelerated(void) {
    if (!accelerated) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no SHA extensions; use hashlib");
        return -1;
    }
    return 0;
}

static int claim(Sha256Object *o) {
    if (o->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Sha256 object used by two threads at once");
        return -1;
    }
    o->busy = 1;
    return 0;
}

static PyObject *Sha256_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"data", NULL};
    Py_buffer data = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|y*:Sha256", kwlist, &data))
        return NULL;
    if (require_accelerated() < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    Sha256Object *o = (Sha256Object *)type->tp_alloc(type, 0);
    if (o == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    memcpy(o->state.h, INITIAL, sizeof INITIAL);
    if (data.obj != NULL) {
        feed1(&o->state, data.buf, (size_t)data.len);
        PyBuffer_Release(&data);
    }
    return (PyObject *)o;
}

static PyObject *Sha256_update(Sha256Object *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    if (claim(self) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (data.len >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS feed1(&self->state, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        feed1(&self->state, data.buf, (size_t)data.len);
    }
    self->busy = 0;
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

static PyObject *Sha256_digest(Sha256Object *self, PyObject *unused) {
    (void)unused;
    if (claim(self) < 0)
        return NULL;
    uint8_t out[32];
    finish(&self->state, out);
    self->busy = 0;
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

static PyObject *Sha256_length(Sha256Object *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->state.length);
}

static PyMethodDef Sha256_methods[] = {
    {"update", (PyCFunction)Sha256_update, METH_O, "Feed octets (any buffer)."},
    {"digest", (PyCFunction)Sha256_digest, METH_NOARGS,
     "The SHA-256 of the octets fed so far (the object can be fed further)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Sha256_getset[] = {
    {"length", (getter)Sha256_length, NULL, "Octets fed so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject Sha256Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsp._sha256x2.Sha256",
    .tp_basicsize = sizeof(Sha256Object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Streaming SHA-256 on the SHA extensions; update() releases the GIL.",
    .tp_new = Sha256_new,
    .tp_methods = Sha256_methods,
    .tp_getset = Sha256_getset,
};

static PyObject *update2(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *a_obj, *b_obj;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "O!O!y*:update2", &Sha256Type, &a_obj, &Sha256Type, &b_obj,
                          &data))
        return NULL;
    Sha256Object *a = (Sha256Object *)a_obj, *b = (Sha256Object *)b_obj;
    if (a == b) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "update2 needs two different Sha256 objects");
        return NULL;
    }
    if (claim(a) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (claim(b) < 0) {
        a->busy = 0;
        PyBuffer_Release(&data);
        return NULL;
    }
    if (data.len >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS feed2(&a->state, &b->state, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        feed2(&a->state, &b->state, data.buf, (size_t)data.len);
    }
    a->busy = b->busy = 0;
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

#define MAX_ENDS 65536 /* layer ends one call may take: far beyond any container's layers */

/* feed_layers(a, b, data, ends): a takes all of data; b takes it too, and at each offset of
 * `ends` (ascending, within data) b's digest is taken and b starts a new message. One call,
 * the GIL released once, for a slice that spans many layers. */
static PyObject *feed_layers(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *a_obj, *b_obj, *ends_obj;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "O!O!y*O:feed_layers", &Sha256Type, &a_obj, &Sha256Type,
                          &b_obj, &data, &ends_obj))
        return NULL;
    Sha256Object *a = (Sha256Object *)a_obj, *b = (Sha256Object *)b_obj;
    PyObject *result = NULL, *seq = NULL;
    size_t *ends = NULL;
    uint8_t *digests = NULL;
    Py_ssize_t count = 0;
    if (a == b) {
        PyErr_SetString(PyExc_ValueError, "feed_layers needs two different Sha256 objects");
        goto done;
    }
    seq = PySequence_Fast(ends_obj, "feed_layers: ends must be a sequence of offsets");
    if (seq == NULL)
        goto done;
    count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_ENDS) {
        PyErr_SetString(PyExc_ValueError, "feed_layers: too many ends");
        goto done;
    }
    ends = PyMem_Malloc(sizeof(size_t) * (size_t)(count ? count : 1));
    digests = PyMem_Malloc(32 * (size_t)(count ? count : 1));
    if (ends == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t end = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i), PyExc_OverflowError);
        if (end == -1 && PyErr_Occurred())
            goto done;
        if (end < 0 || end > data.len || (i > 0 && (size_t)end < ends[i - 1])) {
            PyErr_SetString(PyExc_ValueError,
                            "feed_layers: ends must ascend within the data");
            goto done;
        }
        ends[i] = (size_t)end;
    }
    if (claim(a) < 0)
        goto done;
    if (claim(b) < 0) {
        a->busy = 0;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *p = data.buf;
    size_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        feed2(&a->state, &b->state, p + at, ends[i] - at);
        at = ends[i];
        finish(&b->state, digests + 32 * i);
        memset(&b->state, 0, sizeof b->state);
        memcpy(b->state.h, INITIAL, sizeof INITIAL);
    }
    feed2(&a->state, &b->state, p + at, (size_t)data.len - at);
    Py_END_ALLOW_THREADS
    a->busy = b->busy = 0;
    result = PyList_New(count);
    if (result == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + 32 * i, 32);
        if (d == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, d);
    }
done:
    PyMem_Free(ends);
    PyMem_Free(digests);
    Py_XDECREF(seq);
    PyBuffer_Release(&data);
    return result;
}

/* digests(data, size): the SHA-256 of each size-octet run of data (its length a multiple of
 * size), in order. Runs are independent messages, so two of them take the two interleaved
 * lanes at once: a consumer that checks each layer against its own digest (a MOQT FETCH, whose
 * objects carry no container to hash as a whole) hashes every octet once, at the rate the
 * paired pass hashes two. One call, the GIL released once. */
static PyObject *digests(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer data;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*n:digests", &data, &size))
        return NULL;
    PyObject *result = NULL;
    uint8_t *out = NULL;
    if (size <= 0 || data.len % size != 0) {
        PyErr_SetString(PyExc_ValueError, "digests: size must be positive and divide the data");
        goto done;
    }
    if (require_accelerated() < 0)
        goto done;
    Py_ssize_t count = data.len / size;
    out = PyMem_Malloc(32 * (size_t)(count ? count : 1));
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *p = data.buf;
    size_t run = (size_t)size, blocks = run / 64;
    Py_ssize_t i = 0;
    for (; i + 1 < count; i += 2) {
        State a = {.length = 0, .fill = 0}, b = {.length = 0, .fill = 0};
        memcpy(a.h, INITIAL, sizeof INITIAL);
        memcpy(b.h, INITIAL, sizeof INITIAL);
        const uint8_t *pa = p + run * (size_t)i, *pb = pa + run;
        compress2(a.h, pa, b.h, pb, blocks);
        a.length = b.length = blocks * 64;
        keep_tail(&a, pa + blocks * 64, run - blocks * 64);
        keep_tail(&b, pb + blocks * 64, run - blocks * 64);
        finish(&a, out + 32 * i);
        finish(&b, out + 32 * (i + 1));
    }
    if (i < count) { /* an odd run out: alone */
        State a = {.length = 0, .fill = 0};
        memcpy(a.h, INITIAL, sizeof INITIAL);
        feed1(&a, p + run * (size_t)i, run);
        finish(&a, out + 32 * i);
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    if (result == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)out + 32 * j, 32);
        if (d == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, j, d);
    }
done:
    PyMem_Free(out);
    PyBuffer_Release(&data);
    return result;
}

/* -- two different messages, one per lane --------------------------------------------------- */

/* One message given as pieces (buffers of any sizes), walked block by block for a lane. */
typedef struct {
    Py_buffer *pieces;
    Py_ssize_t count, at; /* pieces, and the one being read */
    size_t offset;        /* within pieces[at] */
    State state;
} Lane;

/* The next run of whole 64-octet blocks of the lane's message: straight from a piece when it
 * holds one or more at `offset`, else one block gathered into `pending` across pieces. 0 at the
 * end (what is left, under 64 octets, waits in `pending` for finish()). */
static size_t next_run(Lane *l, const uint8_t **p) {
    State *s = &l->state;
    while (l->at < l->count) {
        const uint8_t *buf = (const uint8_t *)l->pieces[l->at].buf + l->offset;
        size_t left = (size_t)l->pieces[l->at].len - l->offset;
        if (left == 0) {
            l->at++, l->offset = 0;
            continue;
        }
        if (s->fill != 0 || left < 64) {
            size_t take = 64 - s->fill < left ? 64 - s->fill : left;
            memcpy(s->pending + s->fill, buf, take);
            s->fill += take, s->length += take, l->offset += take;
            if (s->fill == 64) {
                s->fill = 0; /* compressed by the caller before the next call */
                *p = s->pending;
                return 1;
            }
            continue;
        }
        *p = buf;
        return left / 64;
    }
    return 0;
}

/* `blocks` of the run next_run gave were compressed. */
static void took(Lane *l, const uint8_t *p, size_t blocks) {
    if (p != l->state.pending) {
        l->offset += blocks * 64;
        l->state.length += blocks * 64;
    }
}

static void hash_lanes(Lane *a, Lane *b) {
    const uint8_t *pa = NULL, *pb = NULL;
    size_t na = next_run(a, &pa), nb = next_run(b, &pb);
    while (na != 0 && nb != 0) {
        size_t k = na < nb ? na : nb;
        compress2(a->state.h, pa, b->state.h, pb, k);
        took(a, pa, k), took(b, pb, k);
        if ((na -= k) == 0)
            na = next_run(a, &pa);
        else
            pa += k * 64;
        if ((nb -= k) == 0)
            nb = next_run(b, &pb);
        else
            pb += k * 64;
    }
    for (; na != 0; na = next_run(a, &pa)) {
        compress1(a->state.h, pa, na);
        took(a, pa, na);
    }
    for (; nb != 0; nb = next_run(b, &pb)) {
        compress1(b->state.h, pb, nb);
        took(b, pb, nb);
    }
}

static void release_pieces(Py_buffer *pieces, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&pieces[i]);
    PyMem_Free(pieces);
}

/* Take the buffers of a sequence of pieces; NULL (an exception set) on failure. */
static Py_buffer *get_pieces(PyObject *obj, Py_ssize_t *count, size_t *total) {
    PyObject *seq = PySequence_Fast(obj, "digest_pair: a message is a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *pieces = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (pieces == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    *total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &pieces[i], PyBUF_SIMPLE) < 0) {
            release_pieces(pieces, i);
            Py_DECREF(seq);
            return NULL;
        }
        *total += (size_t)pieces[i].len;
    }
    Py_DECREF(seq);
    *count = n;
    return pieces;
}

/* digest_pair(a, b) -> (digest of a, digest of b): two messages, each a sequence of pieces,
 * hashed in one interleaved pass (the two lanes of compress2), the GIL released once. */
static PyObject *digest_pair(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *a_obj, *b_obj;
    if (!PyArg_ParseTuple(args, "OO:digest_pair", &a_obj, &b_obj))
        return NULL;
    if (require_accelerated() < 0)
        return NULL;
    Lane a = {0}, b = {0};
    size_t total_a, total_b;
    a.pieces = get_pieces(a_obj, &a.count, &total_a);
    if (a.pieces == NULL)
        return NULL;
    b.pieces = get_pieces(b_obj, &b.count, &total_b);
    if (b.pieces == NULL) {
        release_pieces(a.pieces, a.count);
        return NULL;
    }
    memcpy(a.state.h, INITIAL, sizeof INITIAL);
    memcpy(b.state.h, INITIAL, sizeof INITIAL);
    uint8_t out[64];
    if (total_a + total_b >= RELEASE_GIL_AT) {
        Py_BEGIN_ALLOW_THREADS hash_lanes(&a, &b);
        finish(&a.state, out);
        finish(&b.state, out + 32);
        Py_END_ALLOW_THREADS
    } else {
        hash_lanes(&a, &b);
        finish(&a.state, out);
        finish(&b.state, out + 32);
    }
    release_pieces(a.pieces, a.count);
    release_pieces(b.pieces, b.count);
    return Py_BuildValue("(y#y#)", (const char *)out, (Py_ssize_t)32, (const char *)out + 32,
                         (Py_ssize_t)32);
}

static PyMethodDef module_methods[] = {
    {"update2", update2, METH_VARARGS,
     "update2(a, b, data): feed the same octets to two Sha256 objects in one interleaved "
     "pass."},
    {"feed_layers", feed_layers, METH_VARARGS,
     "feed_layers(a, b, data, ends) -> list of digests: a takes data; b takes it too, "
     "finishing a message (its digest in the list) and starting the next at each offset of "
     "ends."},
    {"digests", digests, METH_VARARGS,
     "digests(data, size) -> list of digests: the SHA-256 of each size-octet run of data, "
     "two runs at a time on the interleaved lanes."},
    {"digest_pair", digest_pair, METH_VARARGS,
     "digest_pair(a, b) -> (bytes, bytes): the SHA-256 of two messages, each a sequence of "
     "buffers, in one interleaved pass."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "kvsp._sha256x2",
    .m_doc = "Two interleaved SHA-256 streams on the x86 SHA extensions (spec 6.7's two passes).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__sha256x2(void) {
    accelerated = cpu_has_sha();
    if (PyType_Ready(&Sha256Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "accelerated", accelerated) < 0 ||
        PyModule_AddObjectRef(m, "Sha256", (PyObject *)&Sha256Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
