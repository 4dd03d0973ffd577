/* AVX-512 forms of block_kernels.c's products of float32 inputs (weights="int4": decode steps and
   short prompts), and of the C decode step's attention over heads of 64 (llama_step.c's
   attend_span). The same weights and the same exact products q*x, summed in 16 lanes instead of
   8: outputs agree with the AVX2 forms to float rounding, not bit for bit. block_kernels.c and
   llama_step.c call them where wide_kernels() says so: the CPU has AVX-512F and the compiler knows it.

   Why: a one-row product over 4-bit weights was bound by instructions, not memory. On one thread
   of the 2-core AMD EPYC it ran at 13 GB/s with its weights in L2 and in memory alike, where a
   thread streams ~22. A pair of words broadcast to 16 lanes gives 16 of a block's weights per AND,
   conversion and FMA (8 with AVX2): 18 GB/s from L2, 14.5 from memory.

   4-bit inputs (wide_prepare): a block's 32 x's in two halves h = 0, 1 of 16 lanes, over words 2h
   and 2h+1: lane 2i holds x[32g + 8(2h) + i] * 2^-4i and lane 2i+1 holds x[32g + 8(2h+1) + i] * 2^-4i,
   to match the pair of words broadcast as one 64-bit value, lanes 2i and 2i+1 keeping nibble i.
   The block sums xs and xc are block_kernels.c's.

   Attention: a key's 64 floats are 4 registers; the value sums of a key head's up to 4 query heads
   stay in 16 registers over a span (AVX2 has too few to hold them and read and wrote them at every
   entry). One thread over 1,265 entries of the embedded model's 30 layers: 37 GB/s from L3 (26 with
   AVX2), 22.8 from memory (19.5). */
#include <math.h>

#include "block_kernels.h"

#if defined(__clang__) || __GNUC__ >= 8 /* compilers that know AVX-512 intrinsics and target attributes */
#define WIDE 1
#define WIDE_TARGET __attribute__((target("avx2,fma,avx512f")))
#define MAX_ROWS 8 /* as block_kernels.c's */
#define Q8_ROWS 4

static const float PAIR_SCALE[16] = {1.f, 1.f, 0x1p-4f, 0x1p-4f, 0x1p-8f, 0x1p-8f, 0x1p-12f, 0x1p-12f,
                                     0x1p-16f, 0x1p-16f, 0x1p-20f, 0x1p-20f, 0x1p-24f, 0x1p-24f, 0x1p-28f, 0x1p-28f};
static const int PAIR_ORDER[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

WIDE_TARGET static inline __m512i pair_masks(void) {
    return _mm512_setr_epi32(0xF, 0xF, 0xF0, 0xF0, 0xF00, 0xF00, 0xF000, 0xF000, 0xF0000, 0xF0000, 0xF00000, 0xF00000,
                             0xF000000, 0xF000000, (int)0xF0000000u, (int)0xF0000000u);
}

/* words k and k+1 broadcast (a load, no shuffle), each lane its own nibble, as float */
WIDE_TARGET static inline __m512 pair_nibbles(const uint32_t *words, __m512i mask) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_set1_epi64(*(const int64_t *)words), mask));
}

/* acc + sum_g d[g] * xc[g] + m[g] * xs[g], still in 16 lanes (one reduction an output, not two) */
WIDE_TARGET static inline __m512 with_block_terms(__m512 acc, const float *d, const float *xc, const float *m, const float *xs,
                                                  int64_t groups) {
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(d + g), _mm512_loadu_ps(xc + g),
                              _mm512_fmadd_ps(_mm512_loadu_ps(m + g), _mm512_loadu_ps(xs + g), acc));
    if (g < groups) {
        const __mmask16 k = (__mmask16)((1u << (groups - g)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, d + g), _mm512_maskz_loadu_ps(k, xc + g),
                              _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + g), _mm512_maskz_loadu_ps(k, xs + g), acc));
    }
    return acc;
}

/* a's two halves of 8 lanes added */
WIDE_TARGET static inline __m256 halves(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* the sums of a's, b's, c's and e's lanes, in that order: one reduction for four outputs */
WIDE_TARGET static inline __m128 sums4(__m512 a, __m512 b, __m512 c, __m512 e) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(halves(a), halves(b)), _mm256_hadd_ps(halves(c), halves(e)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* one row's x in the layout above; xs[g] = the block's sum, xc[g] = 8 * the sum of its lane-7 x's */
WIDE_TARGET void wide_prepare(const float *x, int64_t groups, float *xp, float *xs, float *xc) {
    const __m512 scale = _mm512_loadu_ps(PAIR_SCALE);
    const __m512i order = _mm512_loadu_si512(PAIR_ORDER);
    for (int64_t j = 0; j < 32 * groups; j += 16)
        _mm512_storeu_ps(xp + j, _mm512_mul_ps(_mm512_permutexvar_ps(order, _mm512_loadu_ps(x + j)), scale));
    q4_block_sums(x, groups, xs, xc);
}

/* one block of output o: sum over its 32 weights of q * x (lanes still apart) */
#define PAIR_PRODUCT(wo, g, x0, x1) \
    _mm512_fmadd_ps(pair_nibbles((wo) + 4 * (g) + 2, mask), x1, _mm512_mul_ps(pair_nibbles((wo) + 4 * (g), mask), x0))

/* one input row, OUT_PASS output features a pass: x read once for all of them, and their sums
   reduced together (reducing each output's 16 lanes apart cost ~14% of a product over 576 inputs) */
#define OUT_PASS 4
WIDE_TARGET static void wide_one_row(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp,
                                     const float *xs, const float *xc, int64_t out_features, const float *bias, float *out) {
    const __m512i mask = pair_masks();
    for (int64_t o = 0; o < out_features; o += OUT_PASS) {
        const int n = out_features - o < OUT_PASS ? (int)(out_features - o) : OUT_PASS;
        const uint32_t *wk[OUT_PASS];
        const float *dk[OUT_PASS];
        __m512 acc[OUT_PASS];
        for (int k = 0; k < OUT_PASS; k++) { /* a short last pass computes its first output again */
            const int64_t ok = o + (k < n ? k : 0);
            wk[k] = w + ok * groups * 4, dk[k] = d + ok * groups, acc[k] = _mm512_setzero_ps();
        }
        for (int64_t g = 0; g < groups; g++) {
            const __m512 x0 = _mm512_loadu_ps(xp + 32 * g), x1 = _mm512_loadu_ps(xp + 32 * g + 16);
            for (int k = 0; k < OUT_PASS; k++) {
                prefetch_weights(wk[k] + 4 * g);
                acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(dk[k][g]), PAIR_PRODUCT(wk[k], g, x0, x1), acc[k]);
            }
        }
        for (int k = 0; k < OUT_PASS; k++)
            acc[k] = with_block_terms(acc[k], dk[k], xc, m + (dk[k] - d), xs, groups);
        float sums[OUT_PASS];
        _mm_storeu_ps(sums, sums4(acc[0], acc[1], acc[2], acc[3]));
        for (int k = 0; k < n; k++) out[o + k] = sums[k] + (bias ? bias[o + k] : 0.f);
    }
}

/* up to 8 input rows: each block's weights converted and scaled by d once for all of them; each row sums its
   block halves in two accumulators (two FMAs a block and row, where a multiply, an FMA and an add were three) */
#define WIDE_ROW_PRODUCT(r)                                                                      \
    if (rows > r) {                                                                              \
        const float *xr = xp + (int64_t)r * groups * 32 + 32 * g;                                \
        acc##r = _mm512_fmadd_ps(q0, _mm512_loadu_ps(xr), acc##r);                                \
        bcc##r = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), bcc##r);                           \
    }
#define WIDE_ROW_OUT(r)                                                                          \
    if (rows > r)                                                                                \
        out[r * out_stride + o] = _mm512_reduce_add_ps(with_block_terms(_mm512_add_ps(acc##r, bcc##r), dof, xc + r * groups, m + o * groups, xs + r * groups, groups)) \
                                  + (bias ? bias[o] : 0.f);

WIDE_TARGET static inline __attribute__((always_inline)) void
wide_rows_n(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp, const float *xs,
            const float *xc, const int rows, int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    const __m512i mask = pair_masks();
    for (int64_t o = 0; o < out_features; o++) {
        const uint32_t *wo = w + o * groups * 4;
        const float *dof = d + o * groups;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, acc4 = acc0, acc5 = acc0, acc6 = acc0, acc7 = acc0;
        __m512 bcc0 = acc0, bcc1 = acc0, bcc2 = acc0, bcc3 = acc0, bcc4 = acc0, bcc5 = acc0, bcc6 = acc0, bcc7 = acc0;
        for (int64_t g = 0; g < groups; g++) {
            const __m512 dg = _mm512_set1_ps(dof[g]);
            const __m512 q0 = _mm512_mul_ps(pair_nibbles(wo + 4 * g, mask), dg), q1 = _mm512_mul_ps(pair_nibbles(wo + 4 * g + 2, mask), dg);
            WIDE_ROW_PRODUCT(0) WIDE_ROW_PRODUCT(1) WIDE_ROW_PRODUCT(2) WIDE_ROW_PRODUCT(3)
            WIDE_ROW_PRODUCT(4) WIDE_ROW_PRODUCT(5) WIDE_ROW_PRODUCT(6) WIDE_ROW_PRODUCT(7)
        }
        WIDE_ROW_OUT(0) WIDE_ROW_OUT(1) WIDE_ROW_OUT(2) WIDE_ROW_OUT(3) WIDE_ROW_OUT(4) WIDE_ROW_OUT(5) WIDE_ROW_OUT(6) WIDE_ROW_OUT(7)
    }
}

/* out[r][o] for `rows` <= 8 prepared rows and out_features o of a 4-bit W (block_kernels.c's q4_chunks) */
WIDE_TARGET void wide_q4_rows(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp,
                              const float *xs, const float *xc, int rows, int64_t out_features, int64_t out_stride,
                              const float *bias, float *out) {
    switch (rows) { /* the row count a constant in each copy: the accumulators stay in registers */
    case 1: wide_one_row(w, d, m, groups, xp, xs, xc, out_features, bias, out); break;
    case 2: wide_rows_n(w, d, m, groups, xp, xs, xc, 2, out_features, out_stride, bias, out); break;
    case 3: wide_rows_n(w, d, m, groups, xp, xs, xc, 3, out_features, out_stride, bias, out); break;
    case 4: wide_rows_n(w, d, m, groups, xp, xs, xc, 4, out_features, out_stride, bias, out); break;
    case 5: wide_rows_n(w, d, m, groups, xp, xs, xc, 5, out_features, out_stride, bias, out); break;
    case 6: wide_rows_n(w, d, m, groups, xp, xs, xc, 6, out_features, out_stride, bias, out); break;
    case 7: wide_rows_n(w, d, m, groups, xp, xs, xc, 7, out_features, out_stride, bias, out); break;
    default: wide_rows_n(w, d, m, groups, xp, xs, xc, MAX_ROWS, out_features, out_stride, bias, out); break;
    }
}

/* 16 signed bytes as float */
WIDE_TARGET static inline __m512 bytes16(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

WIDE_TARGET static inline __attribute__((always_inline)) void
wide_q8_rows_n(const int8_t *q, const float *d, int64_t in_features, const float *x, const int rows, int64_t n,
               int64_t out_stride, const float *bias, float *out) {
    const int64_t groups = in_features / 32;
    for (int64_t o = 0; o < n; o++) {
        const int8_t *qo = q + o * in_features;
        __m512 acc[Q8_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m512 q0 = bytes16(qo + 32 * g), q1 = bytes16(qo + 32 * g + 16), dg = _mm512_set1_ps(d[o * groups + g]);
            for (int r = 0; r < rows; r++) {
                const float *xr = x + r * in_features + 32 * g;
                acc[r] = _mm512_fmadd_ps(dg, _mm512_fmadd_ps(q1, _mm512_loadu_ps(xr + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xr))), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) out[r * out_stride + o] = _mm512_reduce_add_ps(acc[r]) + (bias ? bias[o] : 0.f);
    }
}

/* out[r][o] for `rows` <= 4 input rows and n output features of an 8-bit W (block_kernels.c's q8_chunks) */
WIDE_TARGET void wide_q8_rows(const int8_t *q, const float *d, int64_t in_features, const float *x, int rows, int64_t n,
                              int64_t out_stride, const float *bias, float *out) {
    switch (rows) {
    case 1: wide_q8_rows_n(q, d, in_features, x, 1, n, out_stride, bias, out); break;
    case 2: wide_q8_rows_n(q, d, in_features, x, 2, n, out_stride, bias, out); break;
    case 3: wide_q8_rows_n(q, d, in_features, x, 3, n, out_stride, bias, out); break;
    default: wide_q8_rows_n(q, d, in_features, x, Q8_ROWS, n, out_stride, bias, out); break;
    }
}

/* llama_step.c's attend_span, for head_dim 64 and up to 4 query heads a key head (wide_span_fits):
   the scores of `group` heads over entries [lo, lo + n), and their value sums, in 16 lanes */
#define SPAN_GROUP 4

WIDE_TARGET static inline __attribute__((always_inline)) void
wide_scores_n(const float *q, const int group, const float *keys, int64_t stride, int64_t lo, int64_t n,
              const float *mask_add, const uint8_t *mask_keep, float scale, float *scores) {
    __m512 qv[SPAN_GROUP][4];
    for (int g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) qv[g][i] = _mm512_loadu_ps(q + 64 * g + 16 * i);
    for (int64_t j = 0; j < n; j++) {
        const float *k = keys + (lo + j) * stride;
        const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32), k3 = _mm512_loadu_ps(k + 48);
        for (int g = 0; g < group; g++) {
            const __m512 dot = _mm512_fmadd_ps(qv[g][3], k3, _mm512_fmadd_ps(qv[g][2], k2,
                               _mm512_fmadd_ps(qv[g][1], k1, _mm512_mul_ps(qv[g][0], k0))));
            float score = _mm512_reduce_add_ps(dot) * scale;
            if (mask_add) score += mask_add[lo + j];
            else if (mask_keep && !mask_keep[lo + j]) score = -INFINITY;
            scores[g * n + j] = score;
        }
    }
}

/* out[g] = sum_j scores[g][j] * v_j, the group's 4 x `group` sums in registers over the span */
WIDE_TARGET static inline __attribute__((always_inline)) void
wide_values_n(const int group, const float *values, int64_t stride, int64_t lo, int64_t n, const float *scores, float *out) {
    __m512 acc[SPAN_GROUP][4];
    for (int g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float *v = values + (lo + j) * stride;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32), v3 = _mm512_loadu_ps(v + 48);
        for (int g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * n + j]);
            acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]), acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]), acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + 64 * g + 16 * i, acc[g][i]);
}

int wide_span_fits(int group, int64_t dim) { return dim == 64 && group >= 1 && group <= SPAN_GROUP; }

/* the group count a constant in each copy: the loops unroll and the sums stay in registers */
WIDE_TARGET void wide_scores(const float *q, int group, const float *keys, int64_t stride, int64_t lo, int64_t n,
                             const float *mask_add, const uint8_t *mask_keep, float scale, float *scores) {
    switch (group) {
    case 1: wide_scores_n(q, 1, keys, stride, lo, n, mask_add, mask_keep, scale, scores); break;
    case 2: wide_scores_n(q, 2, keys, stride, lo, n, mask_add, mask_keep, scale, scores); break;
    case 3: wide_scores_n(q, 3, keys, stride, lo, n, mask_add, mask_keep, scale, scores); break;
    default: wide_scores_n(q, SPAN_GROUP, keys, stride, lo, n, mask_add, mask_keep, scale, scores); break;
    }
}

WIDE_TARGET void wide_values(int group, const float *values, int64_t stride, int64_t lo, int64_t n, const float *scores, float *out) {
    switch (group) {
    case 1: wide_values_n(1, values, stride, lo, n, scores, out); break;
    case 2: wide_values_n(2, values, stride, lo, n, scores, out); break;
    case 3: wide_values_n(3, values, stride, lo, n, scores, out); break;
    default: wide_values_n(SPAN_GROUP, values, stride, lo, n, scores, out); break;
    }
}
#else /* never called: wide_kernels() says 0 */
void wide_prepare(const float *x, int64_t groups, float *xp, float *xs, float *xc) {
    (void)x, (void)groups, (void)xp, (void)xs, (void)xc;
}
void wide_q4_rows(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp, const float *xs,
                  const float *xc, int rows, int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    (void)w, (void)d, (void)m, (void)groups, (void)xp, (void)xs, (void)xc, (void)rows, (void)out_features, (void)out_stride,
        (void)bias, (void)out;
}
void wide_q8_rows(const int8_t *q, const float *d, int64_t in_features, const float *x, int rows, int64_t n,
                  int64_t out_stride, const float *bias, float *out) {
    (void)q, (void)d, (void)in_features, (void)x, (void)rows, (void)n, (void)out_stride, (void)bias, (void)out;
}
int wide_span_fits(int group, int64_t dim) {
    (void)group, (void)dim;
    return 0;
}
void wide_scores(const float *q, int group, const float *keys, int64_t stride, int64_t lo, int64_t n, const float *mask_add,
                 const uint8_t *mask_keep, float scale, float *scores) {
    (void)q, (void)group, (void)keys, (void)stride, (void)lo, (void)n, (void)mask_add, (void)mask_keep, (void)scale, (void)scores;
}
void wide_values(int group, const float *values, int64_t stride, int64_t lo, int64_t n, const float *scores, float *out) {
    (void)group, (void)values, (void)stride, (void)lo, (void)n, (void)scores, (void)out;
}
#endif

static int use_wide = -1; /* -1: not yet asked (a benign race: every thread finds the same answer) */

/* Whether the float-input products use the AVX-512 forms (this CPU and compiler have them); `allow` 0
   keeps them on AVX2 (tests compare the two; the load check falls back), 1 lets them use AVX-512
   where they can, -1 only asks. Set it before products run: a product prepared under one form and
   multiplied under the other is wrong. */
int wide_kernels(int allow) {
#ifdef WIDE
    const int available = __builtin_cpu_supports("avx512f");
#else
    const int available = 0;
#endif
    if (allow >= 0 || use_wide < 0) use_wide = available && allow != 0;
    return use_wide;
}
