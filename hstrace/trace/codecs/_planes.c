/* Blosc frames for 2-byte values, each byte plane coded on its own (optional: blosc_planes.py
 * says whether it is built and bound; without it the writer uses c-blosc's own encoder).
 *
 * The frame is plain Blosc 1 (format 2, zstd, byte shuffle, split blocks), the same layout
 * c-blosc writes in its ALWAYS_SPLIT mode, so every Blosc reader (numcodecs, zarr-python,
 * c-blosc2) decodes it: per block, the low bytes of every value, then the high bytes, each a
 * stream of its own. What differs is how a stream is coded. For bf16 activations the high byte
 * (sign and exponent) carries ~4 bits of entropy and the low byte (mantissa) ~8: a byte-wise
 * Huffman code is all there is to gain, and LZ matches are rare and cost more than they save.
 * So each stream is a zstd frame at a fast negative level (blosc_planes.LEVEL) with its
 * literals forced through Huffman (ZSTD_c_literalCompressionMode): the same entropy coder,
 * and matches only where long runs make them cheap to find. Measured on the bench's data (bench/README.md): stored/raw 0.68 against c-blosc
 * zstd-1's 0.69, three times faster to encode, and faster to decode. A stream that does not
 * shrink is stored as it is (as c-blosc does: the decoder copies a stream whose size equals
 * the block's share); once a chunk's first low-byte stream did not shrink, the low bytes of its
 * later blocks are stored without trying. A stream that shrinks below a sixth has runs (zeros,
 * padding, repeated rows) that only LZ matches code well, so it is also tried with zstd
 * level 1 (c-blosc's zstd-1), and the smaller kept.
 *
 * zstd comes from the copy numcodecs bundles (bind() opens it; no zstd headers or library at
 * build time). The frames are standard zstd frames whatever the parameters do, so a zstd that
 * ignored them would only change the speed and the ratio, never what a reader gets back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* c-blosc's format constants (blosc.h, blosc.c). */
#define BLOSC_VERSION_FORMAT 2
#define BLOSC_ZSTD_VERSION_FORMAT 1
#define BLOSC_ZSTD_FORMAT 4
#define BLOSC_DOSHUFFLE 0x1
#define BLOSC_MEMCPYED 0x2
#define HEADER 16           /* BLOSC_MAX_OVERHEAD: a frame never grows past nbytes + 16 */
#define MIN_BUFFERSIZE 128  /* c-blosc splits a block only with this many values or more */
#define MAX_BLOCKSIZE (1 << 28)
/* A stream Huffman-coded below 1/LZ_BELOW of its size is tried with zstd-1's matches too. */
#define LZ_BELOW 6

/* zstd's parameter ids (zstd.h): stable, and the experimental one since zstd 1.4.0. */
#define ZSTD_c_compressionLevel 100
#define ZSTD_c_literalCompressionMode 1002 /* ZSTD_c_experimentalParam5 */
#define ZSTD_ps_enable 1                   /* always Huffman-code literals */
#define ZSTD_reset_session_only 1

typedef void ZSTD_CCtx;
static ZSTD_CCtx *(*zstd_create)(void);
static size_t (*zstd_free)(ZSTD_CCtx *);
static size_t (*zstd_set)(ZSTD_CCtx *, int, int);
static size_t (*zstd_reset)(ZSTD_CCtx *, int);
static size_t (*zstd_compress2)(ZSTD_CCtx *, void *, size_t, const void *, size_t);
static unsigned (*zstd_is_error)(size_t);
static unsigned zstd_version;
typedef void ZSTD_DCtx;
static ZSTD_DCtx *(*zstd_create_d)(void);
static size_t (*zstd_free_d)(ZSTD_DCtx *);
static size_t (*zstd_decompress_d)(ZSTD_DCtx *, void *, size_t, const void *, size_t);

/* Per thread: a zstd context and the shuffled block. Freed when the thread ends. */
typedef struct {
    ZSTD_CCtx *cctx;
    int level, huffman;  /* the parameters cctx holds */
    ZSTD_CCtx *lz;       /* zstd level 1 (c-blosc's zstd-1), for streams that shrink a lot */
    uint8_t *scratch;    /* the shuffled block, then room for one stream's LZ frame */
    size_t scratch_bytes;
    ZSTD_DCtx *dctx;     /* the decoder's */
    uint8_t *planes;     /* the decoder's: a block's decoded streams */
    size_t planes_bytes;
} Local;

static pthread_key_t local_key;
static int bound = 0;

static void local_free(void *p) {
    Local *l = p;
    if (l == NULL) return;
    if (l->cctx != NULL) zstd_free(l->cctx);
    if (l->lz != NULL) zstd_free(l->lz);
    if (l->dctx != NULL) zstd_free_d(l->dctx);
    free(l->scratch);
    free(l->planes);
    free(l);
}

static Local *local_only(void) {
    Local *l = pthread_getspecific(local_key);
    if (l == NULL) {
        l = calloc(1, sizeof(Local));
        if (l == NULL) return NULL;
        if (pthread_setspecific(local_key, l) != 0) {
            free(l);
            return NULL;
        }
    }
    return l;
}

static Local *local_get(size_t scratch_bytes, int level, int huffman) {
    Local *l = local_only();
    if (l == NULL) return NULL;
    if (l->cctx == NULL || l->level != level || l->huffman != huffman) {
        if (l->cctx == NULL && (l->cctx = zstd_create()) == NULL) return NULL;
        /* a stream that did not fit its bound left the session mid-frame, where zstd takes
         * no new parameters */
        if (zstd_is_error(zstd_reset(l->cctx, ZSTD_reset_session_only))) return NULL;
        if (zstd_is_error(zstd_set(l->cctx, ZSTD_c_compressionLevel, level))) return NULL;
        /* 0 leaves zstd's own choice (ZSTD_ps_auto), as a plain level would */
        if (zstd_is_error(zstd_set(l->cctx, ZSTD_c_literalCompressionMode, huffman))) return NULL;
        l->level = level;
        l->huffman = huffman;
    }
    if (l->lz == NULL) {
        if ((l->lz = zstd_create()) == NULL) return NULL;
        if (zstd_is_error(zstd_set(l->lz, ZSTD_c_compressionLevel, 1))) return NULL;
    }
    if (l->scratch_bytes < scratch_bytes) {
        free(l->scratch);
        l->scratch_bytes = 0;
        if ((l->scratch = malloc(scratch_bytes)) == NULL) return NULL;
        l->scratch_bytes = scratch_bytes;
    }
    return l;
}

/* src's n 2-byte values as two planes: low bytes at lo, high bytes at hi (c-blosc's shuffle
 * for typesize 2, little-endian values). */
static void deinterleave(const uint8_t *src, size_t n, uint8_t *lo, uint8_t *hi) {
    size_t i = 0;
#if defined(__SSE2__)
    const __m128i mask = _mm_set1_epi16(0x00FF);
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 2 * i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 2 * i + 16));
        _mm_storeu_si128((__m128i *)(lo + i),
                         _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask)));
        _mm_storeu_si128((__m128i *)(hi + i),
                         _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
    }
#endif
    for (; i < n; i++) {
        lo[i] = src[2 * i];
        hi[i] = src[2 * i + 1];
    }
}

static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void header(uint8_t *out, uint8_t flags, uint32_t nbytes, uint32_t blocksize,
                   uint32_t cbytes) {
    out[0] = BLOSC_VERSION_FORMAT;
    out[1] = BLOSC_ZSTD_VERSION_FORMAT;
    out[2] = flags;
    out[3] = 2; /* typesize */
    put32(out + 4, nbytes);
    put32(out + 8, blocksize);
    put32(out + 12, cbytes);
}

/* The frame of src (n bytes, n even) into out (at least n + HEADER bytes); its length. Runs
 * without the GIL. -1: no memory for this thread's context. */
static Py_ssize_t encode(const uint8_t *src, size_t n, uint8_t *out, size_t blocksize, int level,
                         int huffman) {
    /* c-blosc's compute_blocksize for a forced block size: never past the buffer, a whole
     * number of values. */
    if (blocksize > n) blocksize = n;
    blocksize &= ~(size_t)1;
    size_t nblocks = n / blocksize, leftover = n % blocksize;
    if (leftover) nblocks++;
    Local *l = local_get(blocksize + blocksize / 2, level, huffman);
    if (l == NULL) return -1;
    const size_t cap = n + HEADER; /* past this, the frame is the bytes as they are */
    size_t pos = HEADER + 4 * nblocks;
    int low_raw = 0; /* the chunk's low bytes did not shrink: store the rest as they are */
    for (size_t j = 0; j < nblocks; j++) {
        size_t bsize = (j == nblocks - 1 && leftover) ? leftover : blocksize;
        /* c-blosc's rule (blosc_d): a leftover block is one stream; otherwise one per byte */
        int nsplits = (j == nblocks - 1 && leftover) || bsize / 2 < MIN_BUFFERSIZE ? 1 : 2;
        size_t neblock = bsize / nsplits;
        put32(out + HEADER + 4 * j, (uint32_t)pos);
        deinterleave(src + j * blocksize, bsize / 2, l->scratch, l->scratch + bsize / 2);
        for (int s = 0; s < nsplits; s++) {
            if (pos + 4 >= cap) goto as_is;
            size_t room = cap - pos - 4; /* a stream may use at most this much of out */
            const uint8_t *stream = l->scratch + s * neblock;
            size_t c = neblock;
            if (!(nsplits == 2 && s == 0 && low_raw)) {
                size_t want = neblock - 1 < room ? neblock - 1 : room; /* shrunk, and fits */
                size_t r = zstd_compress2(l->cctx, out + pos + 4, want, stream, neblock);
                if (!zstd_is_error(r) && r > 0 && r < neblock) c = r;
                else if (nsplits == 2 && s == 0) low_raw = 1;
                if (c * LZ_BELOW < neblock && level != 1) {
                    /* Below 1/LZ_BELOW of its size the stream has runs (zeros, repeats) that
                     * only matches code well: Huffman cannot go under a bit per byte. */
                    uint8_t *lz_out = l->scratch + blocksize;
                    size_t z = zstd_compress2(l->lz, lz_out, c - 1, stream, neblock);
                    if (!zstd_is_error(z) && z > 0 && z < c) {
                        memcpy(out + pos + 4, lz_out, z);
                        c = z;
                    }
                }
            }
            if (c == neblock) {
                if (neblock > room) goto as_is;
                memcpy(out + pos + 4, stream, neblock);
            }
            put32(out + pos, (uint32_t)c);
            pos += 4 + c;
        }
    }
    header(out, BLOSC_DOSHUFFLE | (BLOSC_ZSTD_FORMAT << 5), (uint32_t)n, (uint32_t)blocksize,
           (uint32_t)pos);
    return (Py_ssize_t)pos;
as_is: /* incompressible: c-blosc's memcpyed frame, the header and the bytes */
    header(out, BLOSC_DOSHUFFLE | BLOSC_MEMCPYED | (BLOSC_ZSTD_FORMAT << 5), (uint32_t)n,
           (uint32_t)blocksize, (uint32_t)cap);
    memcpy(out + HEADER, src, n);
    return (Py_ssize_t)cap;
}

/* n values from their planes lo and hi into dest (c-blosc's unshuffle for typesize 2). */
static void interleave(const uint8_t *lo, const uint8_t *hi, size_t n, uint8_t *dest) {
    size_t i = 0;
#if defined(__SSE2__)
    for (; i + 16 <= n; i += 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)(lo + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(hi + i));
        _mm_storeu_si128((__m128i *)(dest + 2 * i), _mm_unpacklo_epi8(a, b));
        _mm_storeu_si128((__m128i *)(dest + 2 * i + 16), _mm_unpackhi_epi8(a, b));
    }
#endif
    for (; i < n; i++) {
        dest[2 * i] = lo[i];
        dest[2 * i + 1] = hi[i];
    }
}

static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Decode a split-block frame of 2-byte values (what encode writes, and c-blosc's ALWAYS_SPLIT
 * frames of the same kind) into dest (n bytes). A stream stored as it is is read where it lies
 * in src, not copied out first, and a block's two planes go into dest in one pass: c-blosc
 * copies such a stream out, then unshuffles. 0: done. 1: not such a frame, or not one that
 * decodes to exactly n bytes (corrupt or cut): the caller leaves it to c-blosc, whose error
 * is the one to report. -1: no memory. Runs without the GIL; reads src only within its len. */
static int decode(const uint8_t *src, size_t len, uint8_t *dest, size_t n) {
    if (len < HEADER || src[0] != BLOSC_VERSION_FORMAT || src[1] != BLOSC_ZSTD_VERSION_FORMAT ||
        src[2] != (BLOSC_DOSHUFFLE | (BLOSC_ZSTD_FORMAT << 5)) || src[3] != 2)
        return 1;
    size_t nbytes = get32(src + 4), blocksize = get32(src + 8), cbytes = get32(src + 12);
    if (nbytes != n || cbytes != len || n == 0 || n % 2 || blocksize < 2 * MIN_BUFFERSIZE ||
        blocksize > MAX_BLOCKSIZE || blocksize % 2 || blocksize > n)
        return 1;
    size_t nblocks = n / blocksize, leftover = n % blocksize;
    if (leftover) nblocks++;
    if (HEADER + 4 * nblocks > len) return 1;
    Local *l = local_only();
    if (l == NULL) return -1;
    if (l->dctx == NULL && (l->dctx = zstd_create_d()) == NULL) return -1;
    if (l->planes_bytes < blocksize) {
        free(l->planes);
        l->planes_bytes = 0;
        if ((l->planes = malloc(blocksize)) == NULL) return -1;
        l->planes_bytes = blocksize;
    }
    for (size_t j = 0; j < nblocks; j++) {
        size_t bsize = (j == nblocks - 1 && leftover) ? leftover : blocksize;
        int nsplits = (j == nblocks - 1 && leftover) || bsize / 2 < MIN_BUFFERSIZE ? 1 : 2;
        size_t neblock = bsize / nsplits, pos = get32(src + HEADER + 4 * j);
        const uint8_t *stream[2];
        for (int s = 0; s < nsplits; s++) {
            if (pos < HEADER + 4 * nblocks || pos > len || len - pos < 4) return 1;
            size_t c = get32(src + pos);
            pos += 4;
            if (c == 0 || c > neblock || c > len - pos) return 1;
            if (c == neblock) {
                stream[s] = src + pos;
            } else {
                uint8_t *out = l->planes + s * neblock;
                size_t r = zstd_decompress_d(l->dctx, out, neblock, src + pos, c);
                if (zstd_is_error(r) || r != neblock) return 1;
                stream[s] = out;
            }
            pos += c;
        }
        if (nsplits == 1) stream[1] = stream[0] + bsize / 2; /* one stream: both planes */
        interleave(stream[0], stream[1], bsize / 2, dest + j * blocksize);
    }
    return 0;
}

static PyObject *decompress(PyObject *self, PyObject *args) {
    Py_buffer src, dest;
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "_planes: zstd is not bound (call bind first)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*w*", &src, &dest)) return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = decode(src.buf, (size_t)src.len, dest.buf, (size_t)dest.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dest);
    if (r < 0) return PyErr_NoMemory();
    return PyBool_FromLong(r == 0);
}

static PyObject *compress(PyObject *self, PyObject *args) {
    Py_buffer src, dest;
    Py_ssize_t blocksize;
    int level, huffman;
    if (!bound) {
        PyErr_SetString(PyExc_RuntimeError, "_planes: zstd is not bound (call bind first)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*w*nii", &src, &dest, &blocksize, &level, &huffman))
        return NULL;
    Py_ssize_t r = -2;
    if (src.len % 2 || src.len < 2 * MIN_BUFFERSIZE || src.len > INT32_MAX - HEADER ||
        blocksize < 2 * MIN_BUFFERSIZE || blocksize > MAX_BLOCKSIZE) {
        PyErr_SetString(PyExc_ValueError,
                        "_planes.compress: an even number of bytes, at least 256 and below 2 GiB, "
                        "and a block size of 256 bytes to 256 MiB");
    } else if (dest.len < src.len + HEADER) {
        PyErr_SetString(PyExc_ValueError, "_planes.compress: dest needs len(src) + 16 bytes");
    } else {
        Py_BEGIN_ALLOW_THREADS
        r = encode(src.buf, (size_t)src.len, dest.buf, (size_t)blocksize, level, huffman);
        Py_END_ALLOW_THREADS
        if (r == -1) PyErr_NoMemory();
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dest);
    return r < 0 ? NULL : PyLong_FromSsize_t(r);
}

static PyObject *bind(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (bound) return PyLong_FromUnsignedLong(zstd_version);
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "_planes.bind: %s", dlerror());
        return NULL;
    }
    unsigned (*version)(void) = (unsigned (*)(void))dlsym(lib, "ZSTD_versionNumber");
    zstd_create = (ZSTD_CCtx * (*)(void)) dlsym(lib, "ZSTD_createCCtx");
    zstd_free = (size_t(*)(ZSTD_CCtx *))dlsym(lib, "ZSTD_freeCCtx");
    zstd_set = (size_t(*)(ZSTD_CCtx *, int, int))dlsym(lib, "ZSTD_CCtx_setParameter");
    zstd_reset = (size_t(*)(ZSTD_CCtx *, int))dlsym(lib, "ZSTD_CCtx_reset");
    zstd_compress2 = (size_t(*)(ZSTD_CCtx *, void *, size_t, const void *, size_t))dlsym(
        lib, "ZSTD_compress2");
    zstd_is_error = (unsigned (*)(size_t))dlsym(lib, "ZSTD_isError");
    zstd_create_d = (ZSTD_DCtx * (*)(void)) dlsym(lib, "ZSTD_createDCtx");
    zstd_free_d = (size_t(*)(ZSTD_DCtx *))dlsym(lib, "ZSTD_freeDCtx");
    zstd_decompress_d = (size_t(*)(ZSTD_DCtx *, void *, size_t, const void *, size_t))dlsym(
        lib, "ZSTD_decompressDCtx");
    if (!version || !zstd_create || !zstd_free || !zstd_set || !zstd_reset || !zstd_compress2 ||
        !zstd_is_error || !zstd_create_d || !zstd_free_d || !zstd_decompress_d) {
        dlclose(lib);
        PyErr_SetString(PyExc_OSError, "_planes.bind: the library lacks zstd's functions");
        return NULL;
    }
    zstd_version = version();
    if (zstd_version < 10400) { /* ZSTD_c_literalCompressionMode came with 1.4.0 */
        dlclose(lib);
        PyErr_Format(PyExc_OSError, "_planes.bind: zstd %u is older than 1.4.0", zstd_version);
        return NULL;
    }
    bound = 1; /* the library stays open for the process's life */
    return PyLong_FromUnsignedLong(zstd_version);
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, "bind(path of a library exporting zstd) -> zstd's version"},
    {"compress", compress, METH_VARARGS,
     "compress(src, dest, blocksize, level, huffman) -> the Blosc frame's length in dest"},
    {"decompress", decompress, METH_VARARGS,
     "decompress(frame, dest) -> True if decoded into dest (all of it), False if the frame is "
     "not a split-block frame of 2-byte values that decodes to len(dest) bytes"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hstrace.trace.codecs._planes",
    "Blosc frames for 2-byte values, each byte plane coded on its own (see _planes.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__planes(void) {
    if (pthread_key_create(&local_key, local_free) != 0) {
        PyErr_SetString(PyExc_OSError, "_planes: pthread_key_create failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
