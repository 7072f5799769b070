/* The producer's fast step in one native call (optional: process_sink.native_extension() says
 * whether it is built; without it the same step takes the pure-Python route, writer._Matcher.match and
 * ProcessSink.write_step, with byte-identical results). At the end of the file, the writer
 * process's side of the same step (copy_rows), optional in the same way.
 *
 * One call checks a repeated step of a table against the plan its first write fixed (column
 * names, exact torch.Tensor type, dtype, CPU, contiguous, row shape, equal row counts per axis;
 * Python ints for int64 scalar step columns), reserves room in the staging ring, copies every
 * column into it and publishes the step's descriptor (hstrace/trace/write/ring.py). Anything it does
 * not take (numpy arrays, lists, another shape, a ring without room, a fault flagged, a full
 * descriptor queue) it hands back untouched, and the Python route does exactly what it always
 * did: checks it, stages it, blocks, drops or raises. The checks run before anything is
 * reserved, so a step it refuses leaves no trace in the ring.
 *
 * Why native: the Python route pays for the interpreter running cold after the 10 ms of serving
 * work between steps (bench/README.md "Producer cost"); the torch getters are the same calls
 * here, made back to back from C. No libtorch headers: it reads tensors through their Python
 * attributes, so one build works with every torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ALIGN 64
#define MAX_AXES 8
#define MAX_COLS 64
#define MAX_RANK 8

/* Words of the trailer after the ring (ring.py: HEAD, TAIL, FAULT, PUBLISHED, TAKEN). */
enum { W_HEAD = 0, W_TAIL = 1, W_FAULT = 2, W_PUBLISHED = 3, W_TAKEN = 4 };
/* Axis kinds: where a step's values of the axis come from. */
enum { AX_STEP = 0, AX_REQ = 1, AX_TOK = 2, AX_OTHER = 3 };
/* Columns the writer fills in at the end of the step axis. */
enum { AUTO_SEQ = 0, AUTO_T_NS = 1 };

static PyObject *tensor_type = NULL; /* torch.Tensor, bound once (bind) */
static int impl_word = -1;           /* the word of a tensor object that holds its TensorImpl */
static PyObject *s_dtype, *s_is_cpu, *s_is_contiguous, *s_shape, *s_data_ptr;
static PyObject *s_parts, *s_copy_s;

/* --- Ring: the producer's cursor over the staging ring (head, tail, descriptors published),
 * shared by this module and the Python route (process_sink.py reads and writes its members). */
typedef struct {
    PyObject_HEAD
    char *base;          /* the ring's first byte */
    int64_t *words;      /* the same mapping as int64 words */
    long long ring_bytes, part_bytes, desc_slots, desc_words, liveness_every;
    Py_ssize_t trailer;  /* word index of the trailer */
    Py_ssize_t desc;     /* word index of descriptor slot 0 */
    int ends_fd;
    int enabled;         /* 0: every step takes the Python route (fault seen, CUDA, closed) */
    long long head, tail, published;
    long long taken;     /* steps this module staged itself (tests, benchmarks) */
    PyObject *stats;     /* the sink's stats dict */
    PyObject *on_gone;   /* () -> the TraceError for a writer process that is gone */
} Ring;

static int Ring_init(Ring *self, PyObject *args, PyObject *kw) {
    unsigned long long addr;
    long long ring_bytes, part_bytes, desc_slots, desc_words, liveness_every;
    Py_ssize_t trailer, desc;
    int ends_fd;
    PyObject *stats, *on_gone;
    if (!PyArg_ParseTuple(args, "KLLnnLLiLOO", &addr, &ring_bytes, &part_bytes, &trailer, &desc,
                          &desc_slots, &desc_words, &ends_fd, &liveness_every, &stats, &on_gone))
        return -1;
    if (!PyDict_Check(stats) || !PyCallable_Check(on_gone) || ring_bytes <= 0 ||
        ring_bytes % ALIGN || desc_slots <= 0 || desc_words < 5 || liveness_every <= 0) {
        PyErr_SetString(PyExc_ValueError, "Ring: bad layout");
        return -1;
    }
    self->base = (char *)(uintptr_t)addr;
    self->words = (int64_t *)(uintptr_t)addr;
    self->ring_bytes = ring_bytes;
    self->part_bytes = part_bytes;
    self->trailer = trailer;
    self->desc = desc;
    self->desc_slots = desc_slots;
    self->desc_words = desc_words;
    self->ends_fd = ends_fd;
    self->liveness_every = liveness_every;
    self->enabled = 1;
    self->head = self->tail = self->published = self->taken = 0;
    Py_INCREF(stats);
    Py_XSETREF(self->stats, stats);
    Py_INCREF(on_gone);
    Py_XSETREF(self->on_gone, on_gone);
    return 0;
}

static int Ring_traverse(Ring *self, visitproc visit, void *arg) {
    Py_VISIT(self->stats);
    Py_VISIT(self->on_gone);
    return 0;
}

static int Ring_clear(Ring *self) {
    Py_CLEAR(self->stats);
    Py_CLEAR(self->on_gone);
    return 0;
}

static void Ring_dealloc(Ring *self) {
    PyObject_GC_UnTrack(self);
    Ring_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Ring_members[] = {
    {"head", T_LONGLONG, offsetof(Ring, head), 0, "bytes reserved so far (monotonic counter)"},
    {"tail", T_LONGLONG, offsetof(Ring, tail), 0, "bytes the writer has handed back"},
    {"published", T_LONGLONG, offsetof(Ring, published), 0, "descriptors published"},
    {"taken", T_LONGLONG, offsetof(Ring, taken), READONLY, "steps staged by this module"},
    {"enabled", T_INT, offsetof(Ring, enabled), 0, "0: every step takes the Python route"},
    {NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hstrace.trace.write._native.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_traverse = (traverseproc)Ring_traverse,
    .tp_clear = (inquiry)Ring_clear,
    .tp_members = Ring_members,
    .tp_doc = "The producer's cursor over a staging ring in shared memory.",
};

/* --- Step: one table's plan and its one-call write. */
typedef struct {
    PyObject *name;   /* column name */
    PyObject *tdtype; /* the torch.dtype a tensor of this column must have */
    int rank;         /* row shape rank */
    Py_ssize_t row_shape[MAX_RANK];
    int width;        /* -1 a step-axis column (the row itself), 0 scalar rows, > 0 the width
                         of 1-d rows, -2 anything wider (writer._Matcher.of) */
    int int_ok;       /* a Python int is one int64 row as it is */
    int axis;         /* index of its axis in the plan */
    long long row_bytes;
} Col;

typedef struct {
    int kind;
    PyObject *name;   /* the axis name, looked up in other_axes (AX_OTHER) */
    int first, n_cols; /* producer columns [first, first + n_cols) of cols */
    int n_auto;
    int auto_[2];
    int auto_at[2];   /* their indices in cols */
} Axis;

typedef struct {
    PyObject_HEAD
    Ring *ring;
    long long tid;
    int n_axes, n_cols; /* n_cols counts the auto columns too */
    Axis axes[MAX_AXES];
    Col cols[MAX_COLS];
} Step;

static int Step_traverse(Step *self, visitproc visit, void *arg) {
    Py_VISIT(self->ring);
    for (int k = 0; k < self->n_cols; k++) {
        Py_VISIT(self->cols[k].name);
        Py_VISIT(self->cols[k].tdtype);
    }
    for (int a = 0; a < self->n_axes; a++) Py_VISIT(self->axes[a].name);
    return 0;
}

static int Step_clear(Step *self) {
    Py_CLEAR(self->ring);
    for (int k = 0; k < self->n_cols; k++) {
        Py_CLEAR(self->cols[k].name);
        Py_CLEAR(self->cols[k].tdtype);
    }
    for (int a = 0; a < self->n_axes; a++) Py_CLEAR(self->axes[a].name);
    return 0;
}

static void Step_dealloc(Step *self) {
    PyObject_GC_UnTrack(self);
    Step_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int bad_plan(const char *why) {
    PyErr_Format(PyExc_ValueError, "Step: %s", why);
    return -1;
}

/* Step(ring, table_id, axes): axes in plan order, each (kind, name, cols, auto) with cols
 * ((name, torch dtype, row shape, width, int_ok, row_bytes), ...) and auto (AUTO_*, ...). */
static int Step_init(Step *self, PyObject *args, PyObject *kw) {
    PyObject *ring, *axes;
    long long tid;
    if (!PyArg_ParseTuple(args, "O!LO!", &RingType, &ring, &tid, &PyTuple_Type, &axes)) return -1;
    if (self->ring != NULL) return bad_plan("already initialised");
    Py_ssize_t n_axes = PyTuple_GET_SIZE(axes);
    if (n_axes > MAX_AXES) return bad_plan("too many axes");
    Py_INCREF(ring);
    self->ring = (Ring *)ring;
    self->tid = tid;
    int k = 0;
    for (Py_ssize_t a = 0; a < n_axes; a++) {
        PyObject *ax = PyTuple_GET_ITEM(axes, a), *name, *cols, *autos;
        int kind;
        if (!PyArg_ParseTuple(ax, "iUO!O!", &kind, &name, &PyTuple_Type, &cols, &PyTuple_Type,
                              &autos))
            return -1;
        Axis *A = &self->axes[a];
        A->kind = kind;
        Py_INCREF(name);
        A->name = name;
        self->n_axes = (int)a + 1;
        A->first = k;
        A->n_cols = (int)PyTuple_GET_SIZE(cols);
        A->n_auto = (int)PyTuple_GET_SIZE(autos);
        if (kind < AX_STEP || kind > AX_OTHER || A->n_auto > 2 || (A->n_auto && kind != AX_STEP))
            return bad_plan("bad axis");
        if (k + A->n_cols + A->n_auto > MAX_COLS) return bad_plan("too many columns");
        for (int c = 0; c < A->n_cols; c++, k++) {
            Col *C = &self->cols[k];
            PyObject *cname, *tdtype, *shape;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(cols, c), "UOO!iiL", &cname, &tdtype,
                                  &PyTuple_Type, &shape, &C->width, &C->int_ok, &C->row_bytes))
                return -1;
            Py_INCREF(cname);
            C->name = cname;
            Py_INCREF(tdtype);
            C->tdtype = tdtype;
            self->n_cols = k + 1;
            Py_ssize_t rank = PyTuple_GET_SIZE(shape);
            if (rank > MAX_RANK) return bad_plan("row rank too high");
            C->rank = (int)rank;
            for (Py_ssize_t d = 0; d < rank; d++) {
                C->row_shape[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
                if (C->row_shape[d] == -1 && PyErr_Occurred()) return -1;
            }
            C->axis = (int)a;
        }
        for (int j = 0; j < A->n_auto; j++, k++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(autos, j));
            if (v != AUTO_SEQ && v != AUTO_T_NS) return bad_plan("bad auto column");
            A->auto_[j] = (int)v;
            A->auto_at[j] = k;
            Col *C = &self->cols[k];
            memset(C, 0, sizeof *C);
            C->int_ok = 1;
            C->axis = (int)a;
            C->row_bytes = 8;
            self->n_cols = k + 1;
        }
    }
    return 0;
}

static inline long long align_up(long long n) { return (n + ALIGN - 1) & -(long long)ALIGN; }

static inline double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.perf_counter's clock */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 1: the getter says yes, 0: no, -1: it raised. */
static inline int attr_is(PyObject *v, PyObject *name, PyObject *want) {
    PyObject *o = PyObject_GetAttr(v, name);
    if (o == NULL) return -1;
    int same = o == want;
    Py_DECREF(o);
    return same;
}

static inline int call_is_true(PyObject *v, PyObject *name) {
    PyObject *o = PyObject_CallMethodNoArgs(v, name);
    if (o == NULL) return -1;
    int yes = o == Py_True;
    Py_DECREF(o);
    return yes;
}

/* Rows of tensor v for column C, or -1: not this route, -2: an error is set. */
static Py_ssize_t tensor_rows(PyObject *v, const Col *C, void **ptr) {
    int ok = attr_is(v, s_dtype, C->tdtype);
    if (ok <= 0) return ok - 1;
    ok = attr_is(v, s_is_cpu, Py_True);
    if (ok <= 0) return ok - 1;
    ok = call_is_true(v, s_is_contiguous);
    if (ok <= 0) return ok - 1;
    PyObject *shape = PyObject_GetAttr(v, s_shape);
    if (shape == NULL) return -2;
    Py_ssize_t rows = -1;
    if (!PyTuple_Check(shape)) goto done;
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    Py_ssize_t dims[MAX_RANK + 1];
    if (nd > MAX_RANK + 1) goto done;
    for (Py_ssize_t d = 0; d < nd; d++) {
        dims[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, d));
        if (dims[d] == -1 && PyErr_Occurred()) {
            rows = -2;
            goto done;
        }
    }
    if (C->width == -1) { /* a step-axis column: the row itself */
        if (nd != C->rank) goto done;
        for (int d = 0; d < C->rank; d++)
            if (dims[d] != C->row_shape[d]) goto done;
        rows = 1;
    } else if (C->width == 0) {
        if (nd == 1) rows = dims[0];
    } else if (C->width > 0) {
        if (nd == 2 && dims[1] == C->width) rows = dims[0];
    } else {
        if (nd != C->rank + 1) goto done;
        for (int d = 0; d < C->rank; d++)
            if (dims[d + 1] != C->row_shape[d]) goto done;
        rows = dims[0];
    }
done:
    Py_DECREF(shape);
    if (rows < 0) return rows;
    PyObject *p = PyObject_CallMethodNoArgs(v, s_data_ptr);
    if (p == NULL) return -2;
    *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (*ptr == NULL && PyErr_Occurred()) return -2;
    return rows;
}

static int add_stat(PyObject *stats, PyObject *key, double dt, int as_int) {
    PyObject *old = PyDict_GetItemWithError(stats, key); /* borrowed */
    if (old == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *inc = as_int ? PyLong_FromLong(1) : PyFloat_FromDouble(dt);
    if (inc == NULL) return -1;
    PyObject *now = PyNumber_Add(old, inc);
    Py_DECREF(inc);
    if (now == NULL) return -1;
    int rc = PyDict_SetItem(stats, key, now);
    Py_DECREF(now);
    return rc;
}

/* write(seq, step, req, tok, other_axes) -> True (staged and published) | None (not taken:
 * the Python route does it). Raises only the writer process's gone error, after publishing
 * (as ProcessSink.write_step), or what a getter raised. */
static PyObject *Step_write(Step *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "write(seq, step, req, tok, other_axes)");
        return NULL;
    }
    Ring *r = self->ring;
    if (!r->enabled) Py_RETURN_NONE;
    long long seq = PyLong_AsLongLong(args[0]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    PyObject *step = args[1], *req = args[2], *tok = args[3], *other = args[4];
    if (!PyDict_Check(other)) Py_RETURN_NONE;
    Py_ssize_t given = 1 + (req != Py_None) + (tok != Py_None);
    if (PyDict_GET_SIZE(other)) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(other, &pos, &key, &value)) given += value != Py_None;
    }
    if (given != self->n_axes) Py_RETURN_NONE;

    /* First every column's value (borrowed: the caller's dicts hold them), with a prefetch of
     * each tensor's TensorImpl, so that the getters below find them in cache rather than
     * walking to memory one tensor after the other. */
    PyObject *vals[MAX_COLS];
    for (int a = 0; a < self->n_axes; a++) {
        const Axis *A = &self->axes[a];
        PyObject *values;
        switch (A->kind) {
        case AX_STEP: values = step; break;
        case AX_REQ: values = req; break;
        case AX_TOK: values = tok; break;
        default:
            values = PyDict_GetItemWithError(other, A->name);
            if (values == NULL) {
                if (PyErr_Occurred()) return NULL;
                Py_RETURN_NONE;
            }
        }
        Py_ssize_t n_given;
        if (values == Py_None) {
            if (A->kind != AX_STEP) Py_RETURN_NONE;
            n_given = 0; /* `step or {}` */
        } else {
            if (!PyDict_CheckExact(values)) Py_RETURN_NONE; /* other mappings: Python route */
            n_given = PyDict_GET_SIZE(values);
        }
        if (n_given != A->n_cols) Py_RETURN_NONE;
        for (int c = 0; c < A->n_cols; c++) {
            int k = A->first + c;
            PyObject *v = PyDict_GetItemWithError(values, self->cols[k].name);
            if (v == NULL) {
                if (PyErr_Occurred()) return NULL;
                Py_RETURN_NONE;
            }
            vals[k] = v;
            if (impl_word >= 0 && (PyObject *)Py_TYPE(v) == tensor_type) {
                const char *impl = ((char *const *)v)[impl_word];
                __builtin_prefetch(impl);
                __builtin_prefetch(impl + 64);
                __builtin_prefetch(impl + 128);
            }
        }
    }

    void *src[MAX_COLS];
    int64_t ival[MAX_COLS];
    char is_int[MAX_COLS];
    long long counts[MAX_AXES];
    for (int a = 0; a < self->n_axes; a++) {
        const Axis *A = &self->axes[a];
        Py_ssize_t n = -1;
        for (int c = 0; c < A->n_cols; c++) {
            int k = A->first + c;
            const Col *C = &self->cols[k];
            PyObject *v = vals[k];
            Py_ssize_t rows;
            if (PyLong_CheckExact(v) && C->int_ok) {
                int overflow;
                long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
                if (overflow) Py_RETURN_NONE; /* the general path names it */
                if (x == -1 && PyErr_Occurred()) return NULL;
                is_int[k] = 1;
                ival[k] = x;
                rows = 1;
            } else if ((PyObject *)Py_TYPE(v) == tensor_type) {
                rows = tensor_rows(v, C, &src[k]);
                if (rows == -2) return NULL;
                if (rows < 0) Py_RETURN_NONE;
                is_int[k] = 0;
            } else {
                Py_RETURN_NONE; /* numpy, lists, subclasses: the Python route */
            }
            if (n != rows) {
                if (n >= 0) Py_RETURN_NONE; /* ragged axis: the general path names the columns */
                n = rows;
            }
        }
        for (int j = 0; j < A->n_auto; j++) {
            int k = A->auto_at[j];
            is_int[k] = 1;
            if (A->auto_[j] == AUTO_SEQ) {
                ival[k] = seq;
            } else {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns's clock */
                ival[k] = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
            }
        }
        counts[a] = A->kind == AX_STEP ? 1 : (n > 0 ? n : 0);
    }

    /* One part, every column in plan order at an ALIGN-aligned offset after the previous one
     * (the layout writer_process._write_step reads). */
    long long nb[MAX_COLS], used = 0;
    for (int k = 0; k < self->n_cols; k++) {
        nb[k] = counts[self->cols[k].axis] * self->cols[k].row_bytes;
        used += align_up(nb[k]);
    }
    if (used > r->part_bytes) Py_RETURN_NONE; /* several parts: the Python route */
    int64_t *w = r->words;
    long long j = r->published;
    if (j - __atomic_load_n(&w[r->trailer + W_TAKEN], __ATOMIC_ACQUIRE) >= r->desc_slots)
        Py_RETURN_NONE; /* no free descriptor slot: the step goes down the pipe */
    /* ProcessSink._allocate's room check, without its waits (those are the Python route's). */
    long long tail = __atomic_load_n(&w[r->trailer + W_TAIL], __ATOMIC_ACQUIRE);
    if (tail > r->tail) r->tail = tail;
    if (__atomic_load_n(&w[r->trailer + W_FAULT], __ATOMIC_ACQUIRE)) Py_RETURN_NONE;
    long long head = r->head;
    if (r->tail == head && head % r->ring_bytes) {
        /* Nothing in flight: start over at the ring's start, whose pages are likely still in
         * cache (the Python route would do the same with this cursor). */
        head = r->tail = ((head + r->ring_bytes - 1) / r->ring_bytes) * r->ring_bytes;
        r->head = head;
    }
    long long pos = head % r->ring_bytes;
    long long pad = pos + used > r->ring_bytes ? r->ring_bytes - pos : 0; /* never wrap a part */
    long long need = pad + used;
    if (head + need - r->tail > r->ring_bytes) Py_RETURN_NONE; /* full: block or drop there */
    r->head = head + need;
    __atomic_store_n(&w[r->trailer + W_HEAD], r->head, __ATOMIC_RELEASE);
    long long base = pad ? 0 : pos;
    if (add_stat(r->stats, s_parts, 0.0, 1) < 0) return NULL;

    /* Checked and reserved: from here on the step is staged. A plain memcpy under the GIL, as
     * the serving thread's: releasing it per step would let another thread take the core. */
    double t0 = mono_s();
    char *dst = r->base + base;
    long long off = 0;
    for (int k = 0; k < self->n_cols; k++) {
        if (nb[k]) {
            if (is_int[k])
                memcpy(dst + off, &ival[k], 8);
            else
                memcpy(dst + off, src[k], (size_t)nb[k]);
        }
        off += align_up(nb[k]);
    }
    if (add_stat(r->stats, s_copy_s, mono_s() - t0, 0) < 0) return NULL;

    /* The descriptor, then PUBLISHED: a release store (the writer reads PUBLISHED, then the
     * slot, then the ring bytes). */
    int64_t *slot = &w[r->desc + (j % r->desc_slots) * r->desc_words];
    slot[0] = self->tid;
    slot[1] = base;
    slot[2] = r->head;
    slot[3] = self->n_axes;
    for (int a = 0; a < self->n_axes; a++) slot[4 + a] = counts[a];
    r->published = ++j;
    r->taken++;
    __atomic_store_n(&w[r->trailer + W_PUBLISHED], j, __ATOMIC_RELEASE);
    if (j % r->liveness_every == 0) {
        /* Is the writer process alive: one poll for POLLHUP on the ends pipe, no read. */
        struct pollfd p = {.fd = r->ends_fd, .events = POLLIN, .revents = 0};
        if (poll(&p, 1, 0) > 0 && (p.revents & POLLHUP)) {
            PyObject *exc = PyObject_CallNoArgs(r->on_gone);
            if (exc == NULL) return NULL;
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
            return NULL;
        }
    }
    Py_RETURN_TRUE;
}

static PyMethodDef Step_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Step_write, METH_FASTCALL,
     "write(seq, step, req, tok, other_axes) -> True | None"},
    {NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hstrace.trace.write._native.Step",
    .tp_basicsize = sizeof(Step),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Step_init,
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_traverse = (traverseproc)Step_traverse,
    .tp_clear = (inquiry)Step_clear,
    .tp_methods = Step_methods,
    .tp_doc = "One table's plan and its one-call write into a Ring.",
};

/* bind(torch.Tensor, samples, impls): the one tensor type this module takes, and where a tensor
 * object keeps its TensorImpl pointer, found on sample tensors against their `_cdata` (the
 * TensorImpl's address): the word that holds it in every sample within the object, else none
 * (then no prefetch; only speed depends on it, never what is written). */
static PyObject *bind(PyObject *mod, PyObject *args) {
    PyObject *t, *samples, *impls;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &t, &PyList_Type, &samples, &PyList_Type,
                          &impls))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(samples);
    if (n != PyList_GET_SIZE(impls)) {
        PyErr_SetString(PyExc_ValueError, "bind: one impl address per sample");
        return NULL;
    }
    Py_INCREF(t);
    Py_XSETREF(tensor_type, t);
    impl_word = -1;
    Py_ssize_t words = ((PyTypeObject *)t)->tp_basicsize / (Py_ssize_t)sizeof(void *);
    for (Py_ssize_t i = 2; n > 0 && i < words && impl_word < 0; i++) { /* after PyObject_HEAD */
        int all = 1;
        for (Py_ssize_t j = 0; j < n && all; j++) {
            PyObject *s = PyList_GET_ITEM(samples, j);
            void *want = PyLong_AsVoidPtr(PyList_GET_ITEM(impls, j));
            if (want == NULL && PyErr_Occurred()) return NULL;
            all = (PyObject *)Py_TYPE(s) == t && want != NULL && ((void *const *)s)[i] == want;
        }
        if (all) impl_word = (int)i;
    }
    return PyLong_FromLong(impl_word);
}


/* --- The writer process's side: one step's rows from the ring into the columns' chunk buffers.
 *
 * copy_rows(src, src_bytes, base, counts, state, ncols, slow) -> k. `state` is the address of
 * an int64 array of ncols rows of CR_WORDS words (recorder.py TableLog.fast_state; each
 * RowLog reads and writes its own row): where the column's chunk buffer is (0: none in hand),
 * the rows in it, its chunk's rows, the bytes of a row, which axis of `counts` counts its
 * rows, and a gate (nonzero: this column's rows take the Python route, RowLog.append_from:
 * its first rows since a tail flush, a chunk being encoded). The step's columns lie in the ring
 * at `src` + `base`, each at an ALIGN-aligned offset after the previous one (ProcessSink's
 * layout, writer_process._write_step). Every column with rows that fit its chunk without
 * ending it, and no gate, is one memcpy and its row count advanced; the others are left as
 * they are and listed in `slow` (int64 pairs: column, ring offset), k of them, for the Python
 * route to append in order. Nothing else is touched. */
enum { CR_DST = 0, CR_FILL = 1, CR_CAP = 2, CR_ROWB = 3, CR_AXIS = 4, CR_GATE = 5, CR_WORDS = 8 };

static PyObject *copy_rows(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_rows(src, src_bytes, base, counts: tuple, state, ncols, slow)");
        return NULL;
    }
    char *src = (char *)PyLong_AsVoidPtr(args[0]);
    long long src_bytes = PyLong_AsLongLong(args[1]);
    long long offset = PyLong_AsLongLong(args[2]);
    int64_t *state = (int64_t *)PyLong_AsVoidPtr(args[4]);
    Py_ssize_t ncols = PyLong_AsSsize_t(args[5]);
    int64_t *slow = (int64_t *)PyLong_AsVoidPtr(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (src == NULL || state == NULL || slow == NULL || ncols < 0 || offset < 0 ||
        src_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: a null buffer or a negative size");
        return NULL;
    }
    PyObject *counts = args[3];
    Py_ssize_t n_axes = PyTuple_GET_SIZE(counts);
    if (n_axes > MAX_AXES) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: more axes than MAX_AXES");
        return NULL;
    }
    long long rows[MAX_AXES];
    for (Py_ssize_t a = 0; a < n_axes; a++) {
        rows[a] = PyLong_AsLongLong(PyTuple_GET_ITEM(counts, a));
        if (rows[a] == -1 && PyErr_Occurred()) return NULL;
        if (rows[a] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a negative row count");
            return NULL;
        }
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        int64_t *w = state + i * CR_WORDS;
        if (w[CR_AXIS] < 0 || w[CR_AXIS] >= n_axes || w[CR_ROWB] <= 0) {
            PyErr_Format(PyExc_ValueError, "copy_rows: column %zd has axis %lld of %zd", i,
                         (long long)w[CR_AXIS], n_axes);
            return NULL;
        }
        long long n = rows[w[CR_AXIS]];
        if (n > (1LL << 40) / w[CR_ROWB]) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a row count beyond any ring");
            return NULL;
        }
        long long nb = n * w[CR_ROWB];
        if (n) {
            if (w[CR_DST] != 0 && w[CR_GATE] == 0 && w[CR_FILL] + n < w[CR_CAP] &&
                offset + nb <= src_bytes) {
                memcpy((char *)(uintptr_t)w[CR_DST] + w[CR_FILL] * w[CR_ROWB], src + offset,
                       (size_t)nb);
                w[CR_FILL] += n;
            } else {
                slow[2 * k] = i;
                slow[2 * k + 1] = offset;
                k++;
            }
        }
        offset += (nb + ALIGN - 1) & ~(long long)(ALIGN - 1);
    }
    return PyLong_FromSsize_t(k);
}

static PyMethodDef module_methods[] = {
    {"bind", bind, METH_VARARGS, "bind(torch.Tensor, samples, impls) -> the TensorImpl word or -1"},
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL,
     "copy_rows(src, src_bytes, base, counts, state, ncols, slow) -> columns left to Python"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hstrace.trace.write._native",
    "The producer's fast step, and the writer's rows of a step, in one native call each "
    "(see _native.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&StepType) < 0) return NULL;
#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_dtype, "dtype");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_shape, "shape");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_parts, "parts");
    INTERN(s_copy_s, "copy_s");
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RingType);
    Py_INCREF(&StepType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddObject(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
