/* The vLLM tap thread's per-row math, one native call each (optional: tapmath.native() says
 * whether it is built; without it, or with HSTRACE_NATIVE=0, the same columns come from torch in
 * hstrace/engines/vllm/taps.py).
 *
 *   topk_into    a drafter call's rows: each row's log-sum-exp over the draft vocabulary (read
 *                through the draft->target map) and its top-k, written to the output rows the
 *                caller names (a draft extend's sampled rows; the other rows get the empty row:
 *                ids -1, log-probs -inf, lse NaN). torch's route: index_select, logsumexp, topk,
 *                take, sub, then full x4 and index_copy_ x4 for the extend.
 *   verify_into  a verify's drafted tokens: the raw and processed logit at the token, p(token)
 *                under the processed row and the row's argmax. torch's route: two gathers,
 *                logsumexp, sub, exp and argmax.
 *
 * Why native: on the tap thread, after each engine step, a torch call's dispatch costs more
 * than its arithmetic at a tiny world's sizes, and runs cold (bench/README.md, seventeenth
 * pass: one step's math 150 us through torch back to back and 266 after a 2 ms gap; natively 98
 * and 169).
 *
 * torch's semantics, kept: logsumexp(x) = log(sum(exp(x - m))) + m with m = max(x), m taken
 * as 0 where it is infinite (an all -inf row gives -inf, a +inf gives +inf); a NaN gives NaN;
 * topk and argmax rank NaN above every number; argmax takes the first of equal maxima. The sum
 * is taken in float lanes and then double, so a log-sum-exp may differ from torch's in its last
 * bits (tests/test_tapmath.py bounds it). topk's order among equal values is torch's choice
 * (unspecified): where a row's top-k holds or borders a tie, topk_into says so and the caller
 * takes torch's route for the call, so the ids are torch's bit for bit. Addresses come from
 * hstrace/engines/tapmath.py, which checks device, dtype, strides and shapes first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_K 64

/* a ranks above b: NaN above every number, then the usual order */
static inline int above(float a, float b) {
    if (isnan(a)) return !isnan(b);
    if (isnan(b)) return 0;
    return a > b;
}

/* The top k of x[0..n) (values ranked by `above`, ties broken towards the lower index) into
 * best/at; returns 1 when two of the top k are equal, or a value outside them equals the k-th
 * (torch's order among equal values is its own: the caller then takes torch's route). */
static int row_topk(const float *x, long long n, long long k, int nan, float *best, int64_t *at) {
    long long have = 0;
    for (long long j = 0; j < n; j++) {
        float v = x[j];
        if (have == k && (nan ? !above(v, best[k - 1]) : !(v > best[k - 1]))) continue;
        long long i = have < k ? have++ : k - 1;
        while (i > 0 && (nan ? above(v, best[i - 1]) : v > best[i - 1])) {
            best[i] = best[i - 1];
            at[i] = at[i - 1];
            i--;
        }
        best[i] = v;
        at[i] = j;
    }
    for (long long i = 1; i < k; i++)
        if (best[i] == best[i - 1] || (isnan(best[i]) && isnan(best[i - 1]))) return 1;
    float last = best[k - 1];
    long long equal = 0;
    if (isnan(last)) {
        for (long long j = 0; j < n; j++) equal += isnan(x[j]);
    } else {
        for (long long j = 0; j < n; j++) equal += x[j] == last;
    }
    return equal > 1;
}

/* The kernels twice: 4 lanes (SSE2 registers, any x86-64; NEON elsewhere), and 8 lanes with AVX2
 * and FMA where the CPU has them (chosen at run time: the same build runs on every host; the
 * two round the exp polynomial differently, within the bound tests/test_tapmath.py checks). */
#define W 4
#define NAME(x) x##_w4
#define KATTR
#include "_tapmath_rows.h"
#undef W
#undef NAME
#undef KATTR

#if defined(__x86_64__) && defined(__GNUC__)
#define W 8
#define NAME(x) x##_w8
#define KATTR __attribute__((target("avx2,fma")))
#include "_tapmath_rows.h"
#undef W
#undef NAME
#undef KATTR

static int wide_known = -1; /* -1: not asked yet; set_lanes() may narrow it (tests) */
static int wide(void) {
    if (wide_known < 0)
        wide_known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return wide_known;
}
static int can_wide(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else
#define topk_rows_w8 topk_rows_w4
#define verify_rows_w8 verify_rows_w4
static int wide_known = 0;
static int wide(void) { return 0; }
static int can_wide(void) { return 0; }
#endif

/* lanes([n]) -> the lanes in use (4 or 8); with n, use 4, or 8 where the CPU has AVX2 and FMA. */
static PyObject *lanes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "lanes([n])");
        return NULL;
    }
    if (nargs == 1) {
        long n = PyLong_AsLong(args[0]);
        if (n == -1 && PyErr_Occurred()) return NULL;
        if (n != 4 && n != 8) {
            PyErr_SetString(PyExc_ValueError, "lanes: 4 or 8");
            return NULL;
        }
        wide_known = n == 8 && can_wide();
    }
    return PyLong_FromLong(wide() ? 8 : 4);
}

/* A call's arguments: exactly `n` of them, the integers at `at_int` into `ints` and the
 * addresses at `at_ptr` into `ptrs`; -1 with the error set otherwise. */
static int take_args(PyObject *const *args, Py_ssize_t nargs, int n, const char *usage,
                     const int *at_int, int n_int, long long *ints, const int *at_ptr, int n_ptr,
                     void **ptrs) {
    if (nargs != n) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    for (int i = 0; i < n_int; i++) ints[i] = PyLong_AsLongLong(args[at_int[i]]);
    for (int i = 0; i < n_ptr; i++) ptrs[i] = PyLong_AsVoidPtr(args[at_ptr[i]]);
    return PyErr_Occurred() ? -1 : 0;
}

/* topk_into(src, rows, stride, cols, map, n, k, dest, n_out, ids, tids, lps, lse) -> tie
 * src: float32 rows of `cols` values, `stride` elements apart; map: int64[n], the columns of a
 * row that are its n values (0: the first n = cols columns); dest: None (row r -> output row r,
 * n_out == rows) or a list of `rows` distinct output rows in [0, n_out). Outputs: int64[n_out, k]
 * ids (the value's index among the n) and tids (map[id], or id), float32[n_out, k] lps (value -
 * lse) and float32[n_out] lse; rows no input lands on get -1, -1, -inf, NaN. Returns True where
 * a tie touched a row's top k (the outputs are then not to be used). */
static PyObject *topk_into(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    static const int at_int[] = {1, 2, 3, 5, 6, 8}, at_ptr[] = {0, 4, 9, 10, 11, 12};
    long long v[6];
    void *p[6];
    if (take_args(args, nargs, 13,
                  "topk_into(src, rows, stride, cols, map, n, k, dest, n_out, ids, tids, lps, lse)",
                  at_int, 6, v, at_ptr, 6, p) < 0)
        return NULL;
    long long rows = v[0], stride = v[1], cols = v[2], n = v[3], k = v[4], n_out = v[5];
    const float *src = p[0];
    const int64_t *map = p[1];
    int64_t *ids = p[2], *tids = p[3];
    float *lps = p[4], *lse = p[5];
    PyObject *dest = args[7];
    if (src == NULL || ids == NULL || tids == NULL || lps == NULL || lse == NULL || rows < 0 ||
        cols < 1 || (rows > 1 && stride < cols) || n < 1 || k < 1 || k > n || k > MAX_K ||
        (map == NULL && n != cols) || n_out < rows ||
        (dest == Py_None ? n_out != rows : !PyList_CheckExact(dest) || PyList_GET_SIZE(dest) != rows)) {
        PyErr_SetString(PyExc_ValueError, "topk_into: a null buffer or an impossible shape");
        return NULL;
    }
    int64_t *out_row = PyMem_RawMalloc((size_t)(rows ? rows : 1) * sizeof(int64_t));
    float *gathered = map ? PyMem_RawMalloc((size_t)n * sizeof(float)) : NULL;
    if (out_row == NULL || (map && gathered == NULL)) {
        PyMem_RawFree(out_row);
        PyMem_RawFree(gathered);
        return PyErr_NoMemory();
    }
    int bad = 0;
    for (long long r = 0; r < rows && !bad; r++) {
        long long o = r;
        if (dest != Py_None) {
            o = PyLong_AsLongLong(PyList_GET_ITEM(dest, r));
            if (o == -1 && PyErr_Occurred()) bad = 2;
            else if (o < 0 || o >= n_out) bad = 1;
        }
        out_row[r] = o;
    }
    if (!bad && map)
        for (long long j = 0; j < n; j++)
            if (map[j] < 0 || map[j] >= cols) bad = 1;
    if (bad) {
        PyMem_RawFree(out_row);
        PyMem_RawFree(gathered);
        if (bad == 1) PyErr_SetString(PyExc_ValueError, "topk_into: a row or map entry out of range");
        return NULL;
    }
    if (dest != Py_None) { /* the empty row everywhere first: the sampled rows overwrite it */
        for (long long i = 0; i < n_out * k; i++) {
            ids[i] = tids[i] = -1;
            lps[i] = -INFINITY;
        }
        for (long long i = 0; i < n_out; i++) lse[i] = NAN;
    }
    int tie = wide() ? topk_rows_w8(src, rows, stride, map, n, k, out_row, gathered, ids, tids, lps, lse)
                     : topk_rows_w4(src, rows, stride, map, n, k, out_row, gathered, ids, tids, lps, lse);
    PyMem_RawFree(out_row);
    PyMem_RawFree(gathered);
    return PyBool_FromLong(tie);
}

/* verify_into(proc, proc_stride, raw, raw_stride, rows, vocab, ids, p, zp, z, argmax)
 * proc, raw: float32 rows of `vocab` values; ids: int64[rows] token ids (clamped to the
 * vocabulary, as the torch route's gather indices). Outputs float32[rows] p (exp(zp - lse of
 * the proc row)), zp (proc at the id), z (raw at the id), int64[rows] the proc row's argmax. */
static PyObject *verify_into(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    static const int at_int[] = {1, 3, 4, 5}, at_ptr[] = {0, 2, 6, 7, 8, 9, 10};
    long long v[4];
    void *p[7];
    if (take_args(args, nargs, 11,
                  "verify_into(proc, proc_stride, raw, raw_stride, rows, vocab, ids, p, zp, z, argmax)",
                  at_int, 4, v, at_ptr, 7, p) < 0)
        return NULL;
    long long ps = v[0], rs = v[1], rows = v[2], vocab = v[3];
    const float *proc = p[0], *raw = p[1];
    const int64_t *ids = p[2];
    float *pt = p[3], *zp = p[4], *z = p[5];
    int64_t *amax = p[6];
    if (proc == NULL || raw == NULL || ids == NULL || pt == NULL || zp == NULL || z == NULL ||
        amax == NULL || rows < 0 || vocab < 1 || (rows > 1 && (ps < vocab || rs < vocab))) {
        PyErr_SetString(PyExc_ValueError, "verify_into: a null buffer or an impossible shape");
        return NULL;
    }
    if (wide())
        verify_rows_w8(proc, ps, raw, rs, rows, vocab, ids, pt, zp, z, amax);
    else
        verify_rows_w4(proc, ps, raw, rs, rows, vocab, ids, pt, zp, z, amax);
    Py_RETURN_NONE;
}

/* idx[i] of an int64 (isz 8) or int32 (isz 4) index */
static inline long long index_at(const void *idx, long long isz, long long i) {
    return isz == 8 ? ((const int64_t *)idx)[i] : ((const int32_t *)idx)[i];
}

/* Three of the serving thread's copies (hstrace/engines/tapmath.py: snapshot_head, gather_rows,
 * gather_at):
 * a CPU tensor's bytes into a fresh bytearray, made a tensor on the tap thread. Why: cold, after
 * the engine's own work, vLLM's int32 indices made int64 and an index_select cost 25-35 us on
 * this project's 2-vCPU host (their dispatch, not the bytes); a memcpy costs its bytes.
 *
 * copy_out(addr, nbytes) -> bytearray of the nbytes at addr. */
static PyObject *copy_out(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_out(addr, nbytes)");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    long long n = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || (addr == 0 && n > 0)) {
        PyErr_SetString(PyExc_ValueError, "copy_out: a null address or a negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(n ? (const char *)(uintptr_t)addr : "", (Py_ssize_t)n);
}

/* gather_rows(addr, n_rows, row_stride, row_bytes, idx, idx_itemsize, n_idx) -> bytearray
 * holding rows idx[0..n_idx) of the matrix at addr (n_rows rows of row_bytes, row_stride bytes
 * apart), in that order; idx: int32 or int64 (itemsize 4 or 8). None where an index is out of
 * range (the caller takes torch's route, which raises as the engine would). */
static PyObject *gather_rows(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "gather_rows(addr, n_rows, row_stride, row_bytes, idx, idx_itemsize, n_idx)");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    long long n_rows = PyLong_AsLongLong(args[1]), stride = PyLong_AsLongLong(args[2]);
    long long row_bytes = PyLong_AsLongLong(args[3]);
    unsigned long long idx = PyLong_AsUnsignedLongLong(args[4]);
    long long isz = PyLong_AsLongLong(args[5]), n_idx = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (addr == 0 || (idx == 0 && n_idx > 0) || n_rows < 0 || row_bytes < 0 || n_idx < 0 ||
        (isz != 4 && isz != 8) || (n_rows > 1 && stride < row_bytes)) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: a null buffer or an impossible shape");
        return NULL;
    }
    for (long long i = 0; i < n_idx; i++) {
        long long r = index_at((const void *)(uintptr_t)idx, isz, i);
        if (r < 0 || r >= n_rows) Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n_idx * row_bytes));
    if (out == NULL) return NULL;
    char *dst = PyByteArray_AS_STRING(out);
    const char *src = (const char *)(uintptr_t)addr;
    for (long long i = 0; i < n_idx; i++)
        memcpy(dst + i * row_bytes, src + index_at((const void *)(uintptr_t)idx, isz, i) * stride,
               (size_t)row_bytes);
    return out;
}

/* gather_at(addr, n_rows, row_stride, n_cols, elem_size, rows, rows_isz, cols, cols_isz, n)
 * -> bytearray of the n values m[rows[i], clamp(cols[i], 0, n_cols - 1)] of the matrix at addr
 * (n_rows rows of n_cols values of elem_size bytes, row_stride bytes apart), in that order;
 * rows, cols: int32 or int64 (itemsize 4 or 8). The columns are clamped as the verify's
 * gathers clamp a drafted id; None where a row is out of range (the caller takes torch's
 * route, which raises as the engine would). A verify's raw logit at each drafted token, read
 * before the engine runs: n values, where the drafted rows whole were n rows. */
static PyObject *gather_at(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    static const int at_int[] = {1, 2, 3, 4, 6, 8, 9}, at_ptr[] = {0, 5, 7};
    long long v[7];
    void *p[3];
    if (take_args(args, nargs, 10,
                  "gather_at(addr, n_rows, row_stride, n_cols, elem_size, rows, rows_isz, cols, cols_isz, n)",
                  at_int, 7, v, at_ptr, 3, p) < 0)
        return NULL;
    long long n_rows = v[0], stride = v[1], n_cols = v[2], es = v[3], risz = v[4], cisz = v[5], n = v[6];
    const char *src = p[0];
    const void *rows = p[1], *cols = p[2];
    if (src == NULL || ((rows == NULL || cols == NULL) && n > 0) || n_rows < 0 || n_cols < 1 ||
        n < 0 || (es != 1 && es != 2 && es != 4 && es != 8) || (risz != 4 && risz != 8) ||
        (cisz != 4 && cisz != 8) || (n_rows > 1 && stride < n_cols * es)) {
        PyErr_SetString(PyExc_ValueError, "gather_at: a null buffer or an impossible shape");
        return NULL;
    }
    for (long long i = 0; i < n; i++) {
        long long r = index_at(rows, risz, i);
        if (r < 0 || r >= n_rows) Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * es));
    if (out == NULL) return NULL;
    char *dst = PyByteArray_AS_STRING(out);
    for (long long i = 0; i < n; i++) {
        long long c = index_at(cols, cisz, i);
        c = c < 0 ? 0 : (c >= n_cols ? n_cols - 1 : c);
        memcpy(dst + i * es, src + index_at(rows, risz, i) * stride + c * es, (size_t)es);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"lanes", (PyCFunction)(void (*)(void))lanes, METH_FASTCALL,
     "lanes([n]) -> 4 or 8: the vector width in use; n asks for one (8 only with AVX2 and FMA)"},
    {"topk_into", (PyCFunction)(void (*)(void))topk_into, METH_FASTCALL,
     "topk_into(src, rows, stride, cols, map, n, k, dest, n_out, ids, tids, lps, lse) -> tie"},
    {"verify_into", (PyCFunction)(void (*)(void))verify_into, METH_FASTCALL,
     "verify_into(proc, proc_stride, raw, raw_stride, rows, vocab, ids, p, zp, z, argmax)"},
    {"copy_out", (PyCFunction)(void (*)(void))copy_out, METH_FASTCALL,
     "copy_out(addr, nbytes) -> bytearray: the nbytes at addr"},
    {"gather_rows", (PyCFunction)(void (*)(void))gather_rows, METH_FASTCALL,
     "gather_rows(addr, n_rows, row_stride, row_bytes, idx, idx_itemsize, n_idx) -> bytearray or None"},
    {"gather_at", (PyCFunction)(void (*)(void))gather_at, METH_FASTCALL,
     "gather_at(addr, n_rows, row_stride, n_cols, elem_size, rows, rows_isz, cols, cols_isz, n) -> bytearray or None"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hstrace.engines._tapmath",
    "The vLLM tap thread's per-row math (draft top-k, verify columns), one native call each "
    "(see _tapmath.c).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__tapmath(void) { return PyModule_Create(&module); }
