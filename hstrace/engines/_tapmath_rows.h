/* The vector kernels of _tapmath.c, included once per lane width: W lanes, NAME(x) the
 * width's name for x, KATTR its target attribute (empty for the portable build). */

typedef float NAME(vf) __attribute__((vector_size(W * sizeof(float))));
typedef int32_t NAME(vi) __attribute__((vector_size(W * sizeof(int32_t))));
#define vf NAME(vf)
#define vi NAME(vi)


KATTR static inline __attribute__((always_inline)) vf NAME(vload)(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* exp(x) for x <= 0, to about 1 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r,
 * 2^n through the exponent bits); below -87 (results under 2^-125, nothing next to exp(0) = 1
 * in a sum) it gives 0. */
KATTR static inline __attribute__((always_inline)) vf NAME(vexp_neg)(vf x) {
    const vf lo = (vf){0} - 87.f;
    vi under = x < lo;
    x = (vf)(((vi)x & ~under) | ((vi)lo & under));
    vf fn = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
    vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi bits = (__builtin_convertvector(fn, vi) + 127) << 23;
    vf two;
    memcpy(&two, &bits, sizeof two);
    return (vf)((vi)(p * two) & ~under);
}

/* The largest of n values and whether one is NaN. */
KATTR static inline __attribute__((always_inline)) float NAME(row_max)(const float *x, long long n, int *nan) {
    vf m = (vf){0} - INFINITY;
    vi bad = {0};
    long long j = 0;
    for (; j + W <= n; j += W) {
        vf v = NAME(vload)(x + j);
        bad |= v != v;
        vi gt = v > m;
        m = (vf)(((vi)v & gt) | ((vi)m & ~gt));
    }
    float best = -INFINITY;
    int any = 0;
    for (int l = 0; l < W; l++) {
        any |= bad[l] != 0;
        best = m[l] > best ? m[l] : best;
    }
    for (; j < n; j++) {
        any |= x[j] != x[j];
        best = x[j] > best ? x[j] : best;
    }
    *nan = any;
    return best;
}

/* log-sum-exp of n values whose maximum is m (no NaN among them). */
KATTR static inline __attribute__((always_inline)) float NAME(row_lse)(const float *x, long long n, float m) {
    if (m == INFINITY) return INFINITY;
    if (m == -INFINITY) return -INFINITY;
    vf acc = {0};
    long long j = 0;
    for (; j + W <= n; j += W) acc += NAME(vexp_neg)(NAME(vload)(x + j) - m);
    double s = 0.0;
    for (int l = 0; l < W; l++) s += acc[l];
    for (; j < n; j++) s += expf(x[j] - m);
    return (float)(log(s) + (double)m);
}

/* A drafter call's rows (topk_into): per row, its n values (gathered through `map` when
 * there is one), their max, log-sum-exp and top k, written at output row out_row[r]. Returns 1
 * at the first row whose top k meets a tie (the outputs are then not used). */
KATTR static int NAME(topk_rows)(const float *src, long long rows, long long stride,
                                 const int64_t *map, long long n, long long k,
                                 const int64_t *out_row, float *gathered, int64_t *ids,
                                 int64_t *tids, float *lps, float *lse) {
    float best[MAX_K];
    int64_t at[MAX_K];
    for (long long r = 0; r < rows; r++) {
        const float *x = src + r * stride;
        if (map) {
            for (long long j = 0; j < n; j++) gathered[j] = x[map[j]];
            x = gathered;
        }
        int nan;
        float m = NAME(row_max)(x, n, &nan);
        float l = nan ? NAN : NAME(row_lse)(x, n, m);
        if (row_topk(x, n, k, nan, best, at)) return 1;
        int64_t *ri = ids + out_row[r] * k, *rt = tids + out_row[r] * k;
        float *rl = lps + out_row[r] * k;
        for (long long i = 0; i < k; i++) {
            ri[i] = at[i];
            rt[i] = map ? map[at[i]] : at[i];
            rl[i] = best[i] - l;
        }
        lse[out_row[r]] = l;
    }
    return 0;
}

/* A verify's drafted tokens (verify_into). */
KATTR static void NAME(verify_rows)(const float *proc, long long ps, const float *raw,
                                    long long rs, long long rows, long long vocab,
                                    const int64_t *ids, float *pt, float *zp, float *z,
                                    int64_t *amax) {
    for (long long r = 0; r < rows; r++) {
        const float *x = proc + r * ps;
        long long id = ids[r] < 0 ? 0 : (ids[r] >= vocab ? vocab - 1 : ids[r]);
        int nan;
        float m = NAME(row_max)(x, vocab, &nan);
        float l = nan ? NAN : NAME(row_lse)(x, vocab, m);
        long long best = 0; /* the first NaN, else the first of the maxima */
        if (nan)
            while (x[best] == x[best]) best++;
        else
            while (best < vocab - 1 && x[best] != m) best++;
        zp[r] = x[id];
        z[r] = raw[r * rs + id];
        pt[r] = expf(x[id] - l);
        amax[r] = best;
    }
}

#undef vf
#undef vi
