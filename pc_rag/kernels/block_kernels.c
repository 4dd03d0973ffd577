/* pc-rag's CPU kernels for weights in blocks of 32 (pc_rag/weights/blocks.py builds and loads this
   file): products of float32 activations by 4-bit (GGUF Q4_1-style: scale d and minimum m per
   block, w = d*q + m, q in 0..15) or 8-bit (Q8_0-style: w = d*q, q in -127..127) weights, and the
   weights dequantized. AVX2 + FMA (their AVX-512 forms: wide_kernels.c, used where wide_kernels() says so);
   every product q*x is exact in float32, sums round as any float dot product does.

   4-bit layout: words [O][G][4] uint32, G = I/32. Word k of block g holds weights j = 8k+i
   (i = 0..7) of the block, weight 8k+i in bits 4i..4i+3; bits 28..31 hold q ^ 8, so the lane read
   as a signed int32 is (q - 8) * 2^28. A word broadcast to 8 lanes, masked per lane and converted
   gives q_i * 2^(4i) without a shuffle; the activations are prepared to match:
   xp[g][k][i] = x[32g+8k+i] * 2^-4i (exact), xs[g] = the block's sum of x, xc[g] = 8 * the sum of
   its lane-7 x's. Then y[o] = sum_g d[o][g] * (S[o][g] + xc[g]) + m[o][g] * xs[g].

   8-bit layout: int8 [O][I], scale d [O][G]: y[o] = sum_g d[o][g] * sum_j q_j x_j. */
#include "block_kernels.h"

#define MAX_ROWS 8 /* input rows multiplied per pass over 4-bit weights */
#define Q8_ROWS 4  /* and over 8-bit ones */

static const float LANE_SCALE[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};

static inline __m256i lane_masks(void) {
    return _mm256_setr_epi32(0xF, 0xF0, 0xF00, 0xF000, 0xF0000, 0xF00000, 0xF000000, (int)0xF0000000u);
}

/* xs[g] = block g's sum of x, xc[g] = 8 * the sum of its lane-7 x's (wide_kernels.c's layout shares them) */
void q4_block_sums(const float *x, int64_t groups, float *xs, float *xc) {
    for (int64_t g = 0; g < groups; g++) {
        float sum = 0.f, top = 0.f;
        for (int k = 0; k < 4; k++) {
            const float *src = x + 32 * g + 8 * k;
            for (int i = 0; i < 8; i++) sum += src[i];
            top += src[7];
        }
        xs[g] = sum;
        xc[g] = 8.f * top;
    }
}

static void prepare(const float *x, int64_t groups, float *xp, float *xs, float *xc) {
    const __m256 scale = _mm256_loadu_ps(LANE_SCALE);
    for (int64_t j = 0; j < 32 * groups; j += 8) _mm256_storeu_ps(xp + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), scale));
    q4_block_sums(x, groups, xs, xc);
}

/* one word broadcast from memory (a load, no shuffle), each lane its own nibble, as float */
static inline __m256 nibbles(const uint32_t *word, __m256i mask) {
    __m256i b = _mm256_castps_si256(_mm256_broadcast_ss((const float *)word));
    return _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
}

static inline __m256 bytes8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* sum_g a[g] * b[g] + c[g] * e[g] */
static inline float dot2(const float *a, const float *b, const float *c, const float *e, int64_t groups) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g),
                              _mm256_fmadd_ps(_mm256_loadu_ps(c + g), _mm256_loadu_ps(e + g), acc));
    float t = hsum(acc);
    for (; g < groups; g++) t += a[g] * b[g] + c[g] * e[g];
    return t;
}

#define BLOCK_PRODUCT(q0, q1, q2, q3, xr)                                                        \
    _mm256_fmadd_ps(q3, _mm256_loadu_ps((xr) + 24), _mm256_fmadd_ps(q2, _mm256_loadu_ps((xr) + 16), \
    _mm256_fmadd_ps(q1, _mm256_loadu_ps((xr) + 8), _mm256_mul_ps(q0, _mm256_loadu_ps(xr)))))

/* one input row, two output features a pass (two independent chains keep the FMA units busy) */
static void q4_one_row(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp,
                       const float *xs, const float *xc, int64_t out_features, const float *bias, float *out) {
    const __m256i mask = lane_masks();
    int64_t o = 0;
    for (; o + 2 <= out_features; o += 2) {
        const uint32_t *wa = w + o * groups * 4, *wb = wa + groups * 4;
        const float *da = d + o * groups, *db = da + groups;
        __m256 acc_a = _mm256_setzero_ps(), acc_b = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const float *xr = xp + 32 * g;
            prefetch_weights(wa + 4 * g), prefetch_weights(wb + 4 * g);
            __m256 sa = BLOCK_PRODUCT(nibbles(wa + 4 * g, mask), nibbles(wa + 4 * g + 1, mask),
                                      nibbles(wa + 4 * g + 2, mask), nibbles(wa + 4 * g + 3, mask), xr);
            __m256 sb = BLOCK_PRODUCT(nibbles(wb + 4 * g, mask), nibbles(wb + 4 * g + 1, mask),
                                      nibbles(wb + 4 * g + 2, mask), nibbles(wb + 4 * g + 3, mask), xr);
            acc_a = _mm256_fmadd_ps(_mm256_broadcast_ss(da + g), sa, acc_a);
            acc_b = _mm256_fmadd_ps(_mm256_broadcast_ss(db + g), sb, acc_b);
        }
        out[o] = hsum(acc_a) + dot2(da, xc, m + o * groups, xs, groups) + (bias ? bias[o] : 0.f);
        out[o + 1] = hsum(acc_b) + dot2(db, xc, m + (o + 1) * groups, xs, groups) + (bias ? bias[o + 1] : 0.f);
    }
    for (; o < out_features; o++) {
        const uint32_t *wo = w + o * groups * 4;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(d + o * groups + g),
                                  BLOCK_PRODUCT(nibbles(wo + 4 * g, mask), nibbles(wo + 4 * g + 1, mask),
                                                nibbles(wo + 4 * g + 2, mask), nibbles(wo + 4 * g + 3, mask), xp + 32 * g),
                                  acc);
        out[o] = hsum(acc) + dot2(d + o * groups, xc, m + o * groups, xs, groups) + (bias ? bias[o] : 0.f);
    }
}

/* up to 8 input rows: each block's weights converted once for all of them; one named accumulator a
   row, so they stay in registers. A row's sum is formed exactly as q4_one_row forms it (the block's
   product, then scaled by d into the row's sum), so a row's outputs do not depend on how many rows
   share the pass: a batch decodes bit for bit as its rows alone. Scaling the weights by d once for
   all rows instead saved FMAs but not time (the pass is bound by loads as much). */
#define ROW_PRODUCT(r)                                                                          \
    if (rows > r) {                                                                             \
        const float *xr = xp + (int64_t)r * groups * 32 + 32 * g;                               \
        acc##r = _mm256_fmadd_ps(dg, BLOCK_PRODUCT(q0, q1, q2, q3, xr), acc##r);               \
    }
#define ROW_OUT(r)                                                                              \
    if (rows > r)                                                                               \
        out[r * out_stride + o] = hsum(acc##r) + dot2(dof, xc + r * groups, m + o * groups, xs + r * groups, groups) \
                                  + (bias ? bias[o] : 0.f);

static inline __attribute__((always_inline)) void
q4_rows_n(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp, const float *xs,
          const float *xc, const int rows, int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    const __m256i mask = lane_masks();
    for (int64_t o = 0; o < out_features; o++) {
        const uint32_t *wo = w + o * groups * 4;
        const float *dof = d + o * groups;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0, acc6 = acc0, acc7 = acc0;
        for (int64_t g = 0; g < groups; g++) {
            const __m256 dg = _mm256_broadcast_ss(dof + g);
            const __m256 q0 = nibbles(wo + 4 * g, mask), q1 = nibbles(wo + 4 * g + 1, mask);
            const __m256 q2 = nibbles(wo + 4 * g + 2, mask), q3 = nibbles(wo + 4 * g + 3, mask);
            ROW_PRODUCT(0) ROW_PRODUCT(1) ROW_PRODUCT(2) ROW_PRODUCT(3)
            ROW_PRODUCT(4) ROW_PRODUCT(5) ROW_PRODUCT(6) ROW_PRODUCT(7)
        }
        ROW_OUT(0) ROW_OUT(1) ROW_OUT(2) ROW_OUT(3) ROW_OUT(4) ROW_OUT(5) ROW_OUT(6) ROW_OUT(7)
    }
}

/* q4_rows_n with the row count a constant in each copy: the compiler keeps the accumulators in registers */
static void q4_rows(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp,
                    const float *xs, const float *xc, int rows, int64_t out_features, int64_t out_stride,
                    const float *bias, float *out) {
    switch (rows) {
    case 2: q4_rows_n(w, d, m, groups, xp, xs, xc, 2, out_features, out_stride, bias, out); break;
    case 3: q4_rows_n(w, d, m, groups, xp, xs, xc, 3, out_features, out_stride, bias, out); break;
    case 4: q4_rows_n(w, d, m, groups, xp, xs, xc, 4, out_features, out_stride, bias, out); break;
    case 5: q4_rows_n(w, d, m, groups, xp, xs, xc, 5, out_features, out_stride, bias, out); break;
    case 6: q4_rows_n(w, d, m, groups, xp, xs, xc, 6, out_features, out_stride, bias, out); break;
    case 7: q4_rows_n(w, d, m, groups, xp, xs, xc, 7, out_features, out_stride, bias, out); break;
    default: q4_rows_n(w, d, m, groups, xp, xs, xc, 8, out_features, out_stride, bias, out); break;
    }
}

/* how many chunks q4_chunks and q8_chunks split `out_features` into */
int64_t block_chunks(int64_t out_features) { return chunk_count(out_features); }

/* x's rows prepared for q4_chunks: rows * (I + 2 * I / 32) floats of scratch */
void q4_prepare(const float *x, int64_t rows, int64_t in_features, float *scratch) {
    const int64_t groups = in_features / 32;
    float *xp = scratch, *xs = scratch + rows * in_features, *xc = xs + rows * groups;
    const int wide = wide_kernels(-1); /* wide_kernels.c's AVX-512 forms read their own layout */
    for (int64_t r = 0; r < rows; r++)
        (wide ? wide_prepare : prepare)(x + r * in_features, groups, xp + r * in_features, xs + r * groups, xc + r * groups);
}

/* chunks [c0, c1) of CHUNK output features of out[rows][O] = x[rows][I] @ W^T (+ bias), 4-bit W, from
   q4_prepare's scratch: each output summed by one call in one order, however chunks are shared out */
void q4_chunks(const float *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d,
               const float *m, int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1) {
    const int64_t groups = in_features / 32;
    const float *xp = scratch, *xs = scratch + rows * in_features, *xc = xs + rows * groups;
    const int wide = wide_kernels(-1);
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o0 = c * CHUNK, n = out_features - o0 < CHUNK ? out_features - o0 : CHUNK;
        const uint32_t *wc = w + o0 * groups * 4;
        const float *dc = d + o0 * groups, *mc = m + o0 * groups, *bc = bias ? bias + o0 : 0;
        for (int64_t r = 0; r < rows; r += MAX_ROWS) {
            const int nr = rows - r < MAX_ROWS ? (int)(rows - r) : MAX_ROWS;
            if (wide)
                wide_q4_rows(wc, dc, mc, groups, xp + r * in_features, xs + r * groups, xc + r * groups, nr, n, out_features,
                             bc, out + r * out_features + o0);
            else if (nr == 1)
                q4_one_row(wc, dc, mc, groups, xp + r * in_features, xs + r * groups, xc + r * groups, n, bc,
                           out + r * out_features + o0);
            else
                q4_rows(wc, dc, mc, groups, xp + r * in_features, xs + r * groups, xc + r * groups, nr, n,
                        out_features, bc, out + r * out_features + o0);
        }
    }
}

/* out[rows][O] = x[rows][I] @ W^T (+ bias) for 4-bit W. scratch: rows * (I + 2 * I / 32) floats. */
void q4_matmul(const float *x, int64_t rows, int64_t in_features, const uint32_t *w, const float *d,
               const float *m, int64_t out_features, const float *bias, float *out, float *scratch, int threads) {
    const int64_t chunks = chunk_count(out_features);
    q4_prepare(x, rows, in_features, scratch);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, rows, out_features, in_features))
    for (int64_t c = 0; c < chunks; c++)
        q4_chunks(scratch, rows, in_features, w, d, m, out_features, bias, out, c, c + 1);
}

/* rows [o0, o0 + n) of an 8-bit W times up to Q8_ROWS input rows */
static inline __attribute__((always_inline)) void
q8_rows_n(const int8_t *q, const float *d, int64_t in_features, const float *x, const int rows, int64_t n,
          int64_t out_stride, const float *bias, float *out) {
    const int64_t groups = in_features / 32;
    for (int64_t o = 0; o < n; o++) {
        const int8_t *qo = q + o * in_features;
        __m256 acc[Q8_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m256 q0 = bytes8(qo + 32 * g), q1 = bytes8(qo + 32 * g + 8);
            const __m256 q2 = bytes8(qo + 32 * g + 16), q3 = bytes8(qo + 32 * g + 24);
            const __m256 dg = _mm256_broadcast_ss(d + o * groups + g);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(dg, BLOCK_PRODUCT(q0, q1, q2, q3, x + r * in_features + 32 * g), acc[r]);
        }
        for (int r = 0; r < rows; r++)
            out[r * out_stride + o] = hsum(acc[r]) + (bias ? bias[o] : 0.f);
    }
}

static void q8_rows(const int8_t *q, const float *d, int64_t in_features, const float *x, int rows, int64_t n,
                    int64_t out_stride, const float *bias, float *out) {
    switch (rows) {
    case 1: q8_rows_n(q, d, in_features, x, 1, n, out_stride, bias, out); break;
    case 2: q8_rows_n(q, d, in_features, x, 2, n, out_stride, bias, out); break;
    case 3: q8_rows_n(q, d, in_features, x, 3, n, out_stride, bias, out); break;
    default: q8_rows_n(q, d, in_features, x, 4, n, out_stride, bias, out); break;
    }
}

/* chunks [c0, c1) of CHUNK output features of out[rows][O] = x[rows][I] @ W^T (+ bias), 8-bit W */
void q8_chunks(const float *x, int64_t rows, int64_t in_features, const int8_t *q, const float *d,
               int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1) {
    const int64_t groups = in_features / 32;
    const int wide = wide_kernels(-1);
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o0 = c * CHUNK, n = out_features - o0 < CHUNK ? out_features - o0 : CHUNK;
        for (int64_t r = 0; r < rows; r += Q8_ROWS)
            (wide ? wide_q8_rows : q8_rows)(q + o0 * in_features, d + o0 * groups, in_features, x + r * in_features,
                    rows - r < Q8_ROWS ? (int)(rows - r) : Q8_ROWS, n, out_features, bias ? bias + o0 : 0,
                    out + r * out_features + o0);
    }
}

/* out[rows][O] = x[rows][I] @ W^T (+ bias) for 8-bit W, on `threads` threads */
void q8_matmul(const float *x, int64_t rows, int64_t in_features, const int8_t *q, const float *d,
               int64_t out_features, const float *bias, float *out, int threads) {
    const int64_t chunks = chunk_count(out_features);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, rows, out_features, in_features))
    for (int64_t c = 0; c < chunks; c++)
        q8_chunks(x, rows, in_features, q, d, out_features, bias, out, c, c + 1);
}

/* float32 rows [o0, o1) of a 4-bit W: fl(d*q + m), one rounding, as GGUF's dequantization gives */
void q4_dequantize(const uint32_t *w, const float *d, const float *m, int64_t in_features, int64_t o0, int64_t o1,
                   float *out, int threads) {
    const int64_t groups = in_features / 32;
    const __m256i mask = lane_masks();
    const __m256 scale = _mm256_loadu_ps(LANE_SCALE), offset = _mm256_setr_ps(0, 0, 0, 0, 0, 0, 0, 8.f);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, 1, o1 - o0, in_features))
    for (int64_t o = o0; o < o1; o++) {
        const uint32_t *wo = w + o * groups * 4;
        float *row = out + (o - o0) * in_features;
        for (int64_t g = 0; g < groups; g++) {
            const __m256 dg = _mm256_broadcast_ss(d + o * groups + g), mg = _mm256_broadcast_ss(m + o * groups + g);
            for (int k = 0; k < 4; k++) {
                const __m256 q = _mm256_fmadd_ps(nibbles(wo + 4 * g + k, mask), scale, offset); /* q, exactly */
                _mm256_storeu_ps(row + 32 * g + 8 * k, _mm256_fmadd_ps(q, dg, mg));
            }
        }
    }
}

/* float32 rows [o0, o1) of an 8-bit W: d*q (exact for an fp16 d) */
void q8_dequantize(const int8_t *q, const float *d, int64_t in_features, int64_t o0, int64_t o1, float *out,
                   int threads) {
    const int64_t groups = in_features / 32;
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, 1, o1 - o0, in_features))
    for (int64_t o = o0; o < o1; o++)
        for (int64_t g = 0; g < groups; g++) {
            const __m256 dg = _mm256_broadcast_ss(d + o * groups + g);
            for (int k = 0; k < 4; k++)
                _mm256_storeu_ps(out + (o - o0) * in_features + 32 * g + 8 * k, _mm256_mul_ps(bytes8(q + o * in_features + 32 * g + 8 * k), dg));
        }
}
