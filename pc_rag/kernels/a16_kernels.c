/* The C decode step's 4-bit products under weights="int4" on AVX512-VNNI (llama_step.c, where
   a16_kernels() says so): block_kernels.c's 4-bit weights times inputs rounded to 16 bits a block, in
   integer dot products (vpdpbusd). A row's arithmetic is the same at every row count, so its outputs do
   not depend on the rows beside it. Prefill and the tensor ops keep the float32-input forms
   (block_kernels.c, wide_kernels.c), as do CPUs without VNNI.

   Why: a decode step's products ran at ~60% of the rate one thread streams. Their float form spent
   ~7 AVX-512 instructions a block, and reading four output features' rows side by side (to share
   each input's load among them) was itself that slow: the same reads without the arithmetic ran at
   15.5 GB/s against 23.5 for one row after another (2-core AMD EPYC, one thread, weights in memory).
   Here a block costs ~3 instructions and the rows are read one after another: 18 GB/s against 13.

   Inputs: each block of 32 x becomes X = round(x / s) (half to even), s = max|x| / 32512, so that
   X = 256 * H + L with H and L signed bytes (H = (X + 128) >> 8, L = X - 256 * H; 32512 = 127 * 256
   keeps H within -127..127). A block's 16 bytes of words read as nibbles give its even-numbered weights
   (low nibbles) and its odd ones (high nibbles), 4 to a 32-bit lane; so each row is stored as H of the
   evens, H of the odds, L of the evens, L of the odds (16 bytes a block each), then s repeated for the
   4 lanes of its block, then s * sum(X) a block. A lane's integer sum over its 8 weights (< 2^22) is
   exact; y[o] = sum_g d[o][g] * s[g] * (q . X)_g + m[o][g] * s[g] * sum(X)_g: the products of the inputs
   as rounded (each within half a step, 2^-16 of the block's largest), exact, summed in float32. */
#include <math.h>

#include "block_kernels.h"

#define A16_LIMIT 32512.f /* 127 * 256 */
#define A16_ROWS 8        /* input rows multiplied per pass over the weights (as block_kernels.c's) */

/* a prepared row: 64 bytes of H and L and 5 floats (s four times, s * sum(X)) a block */
static inline int64_t row_bytes(int64_t groups) { return 84 * groups; }

#if defined(__clang__) || __GNUC__ >= 8 /* compilers that know AVX512-VNNI intrinsics and target attributes */
#define A16 1
#define A16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))

/* one row's x in the layout above */
A16_TARGET static void prepare_row(const float *x, int64_t groups, int8_t *row) {
    int8_t *high_even = row, *high_odd = row + 16 * groups, *low_even = row + 32 * groups, *low_odd = row + 48 * groups;
    float *scales = (float *)(row + 64 * groups), *sums = scales + 4 * groups;
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1)), half = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < groups; g++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * g), x1 = _mm512_loadu_ps(x + 32 * g + 16);
        const int unordered = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
        /* a NaN or infinite input gives s NaN or infinite, so the outputs are NaN, as a float product's (max drops NaNs) */
        const float top = unordered ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float scale = top / A16_LIMIT, inverse = scale > 0.f && scale <= 3.4e38f ? 1.f / scale : 0.f;
        const __m512 by = _mm512_set1_ps(inverse);
        const __m512i even = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(x0, evens, x1), by));
        const __m512i odd = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(x0, odds, x1), by));
        const __m512i even_high = _mm512_srai_epi32(_mm512_add_epi32(even, half), 8);
        const __m512i odd_high = _mm512_srai_epi32(_mm512_add_epi32(odd, half), 8);
        _mm_storeu_si128((__m128i *)(high_even + 16 * g), _mm512_cvtepi32_epi8(even_high));
        _mm_storeu_si128((__m128i *)(high_odd + 16 * g), _mm512_cvtepi32_epi8(odd_high));
        _mm_storeu_si128((__m128i *)(low_even + 16 * g), _mm512_cvtepi32_epi8(_mm512_sub_epi32(even, _mm512_slli_epi32(even_high, 8))));
        _mm_storeu_si128((__m128i *)(low_odd + 16 * g), _mm512_cvtepi32_epi8(_mm512_sub_epi32(odd, _mm512_slli_epi32(odd_high, 8))));
        _mm_storeu_ps(scales + 4 * g, _mm_set1_ps(scale));
        sums[g] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(even, odd));
    }
}

/* the sum of a's 16 lanes, in one fixed order whatever the row count */
A16_TARGET static inline float lanes_sum(__m512 a) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
}

/* acc + sum_g m[g] * sums[g], still in 16 lanes */
A16_TARGET static inline __m512 with_minimums(__m512 acc, const float *m, const float *sums, int64_t groups) {
    int64_t g = 0;
    for (; g + 16 <= groups; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(m + g), _mm512_loadu_ps(sums + g), acc);
    if (g < groups) {
        const __mmask16 k = (__mmask16)((1u << (groups - g)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + g), _mm512_maskz_loadu_ps(k, sums + g), acc);
    }
    return acc;
}

/* out[r][o] for `rows` prepared rows, one output feature at a time: its weights read in order, each
   4 blocks' nibbles split once for every row; a row's arithmetic is the same at every row count */
A16_TARGET static inline __attribute__((always_inline)) void
rows_n(const uint32_t *w, const float *d, const float *m, int64_t groups, const int8_t *prepared, const int rows,
       int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0F), top_fix = _mm512_set1_epi32(0x08000000);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); /* a block's d to its 4 lanes */
    const int64_t stride = row_bytes(groups);
    for (int64_t o = 0; o < out_features; o++) {
        const uint32_t *wo = w + o * groups * 4;
        const float *dof = d + o * groups;
        __m512 acc[A16_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g += 4) { /* 4 blocks: 16 words, one 32-bit lane each */
            const int blocks = groups - g < 4 ? (int)(groups - g) : 4;
            const __mmask16 lanes = (__mmask16)((1u << (4 * blocks)) - 1);
            prefetch_weights(wo + 4 * g);
            const __m512i words = _mm512_maskz_loadu_epi32(lanes, wo + 4 * g);
            const __m512i even = _mm512_and_si512(words, low); /* bits 28..31 hold q ^ 8: the odd lanes' fix */
            const __m512i odd = _mm512_ternarylogic_epi32(_mm512_srli_epi32(words, 4), low, top_fix, 0x6A); /* (a & b) ^ c */
            const __m512 dg = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps((__mmask16)((1u << blocks) - 1), dof + g));
            for (int r = 0; r < rows; r++) {
                const int8_t *row = prepared + r * stride;
                __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, _mm512_maskz_loadu_epi32(lanes, row + 16 * g));
                t = _mm512_dpbusd_epi32(t, odd, _mm512_maskz_loadu_epi32(lanes, row + 16 * (groups + g)));
                t = _mm512_slli_epi32(t, 8);
                t = _mm512_dpbusd_epi32(t, even, _mm512_maskz_loadu_epi32(lanes, row + 16 * (2 * groups + g)));
                t = _mm512_dpbusd_epi32(t, odd, _mm512_maskz_loadu_epi32(lanes, row + 16 * (3 * groups + g)));
                const __m512 scale = _mm512_maskz_loadu_ps(lanes, (const float *)(row + 64 * groups) + 4 * g);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dg, scale), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            const float *sums = (const float *)(prepared + r * stride + 64 * groups) + 4 * groups;
            out[r * out_stride + o] = lanes_sum(with_minimums(acc[r], m + o * groups, sums, groups)) + (bias ? bias[o] : 0.f);
        }
    }
}

A16_TARGET static void prepare_rows(const float *x, int64_t rows, int64_t in_features, void *scratch) {
    const int64_t groups = in_features / 32;
    for (int64_t r = 0; r < rows; r++) prepare_row(x + r * in_features, groups, (int8_t *)scratch + r * row_bytes(groups));
}

/* out[r][o] for `rows` <= 8 prepared rows and out_features o of a 4-bit W */
A16_TARGET static void rows_of(const uint32_t *w, const float *d, const float *m, int64_t groups, const int8_t *prepared, int rows,
                               int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    switch (rows) { /* the row count a constant in each copy: the accumulators stay in registers */
    case 1: rows_n(w, d, m, groups, prepared, 1, out_features, out_stride, bias, out); break;
    case 2: rows_n(w, d, m, groups, prepared, 2, out_features, out_stride, bias, out); break;
    case 3: rows_n(w, d, m, groups, prepared, 3, out_features, out_stride, bias, out); break;
    case 4: rows_n(w, d, m, groups, prepared, 4, out_features, out_stride, bias, out); break;
    case 5: rows_n(w, d, m, groups, prepared, 5, out_features, out_stride, bias, out); break;
    case 6: rows_n(w, d, m, groups, prepared, 6, out_features, out_stride, bias, out); break;
    case 7: rows_n(w, d, m, groups, prepared, 7, out_features, out_stride, bias, out); break;
    default: rows_n(w, d, m, groups, prepared, A16_ROWS, out_features, out_stride, bias, out); break;
    }
}
#else /* never called: a16_kernels() says 0 */
static void prepare_rows(const float *x, int64_t rows, int64_t in_features, void *scratch) {
    (void)x, (void)rows, (void)in_features, (void)scratch;
}
static void rows_of(const uint32_t *w, const float *d, const float *m, int64_t groups, const int8_t *prepared, int rows,
                    int64_t out_features, int64_t out_stride, const float *bias, float *out) {
    (void)w, (void)d, (void)m, (void)groups, (void)prepared, (void)rows, (void)out_features, (void)out_stride, (void)bias, (void)out;
}
#endif

/* x's rows prepared for a16_chunks: rows * 84 * I / 32 bytes of scratch */
void a16_prepare(const float *x, int64_t rows, int64_t in_features, void *scratch) { prepare_rows(x, rows, in_features, scratch); }

/* chunks [c0, c1) of CHUNK output features of out[rows][O] = x[rows][I] @ W^T (+ bias), 4-bit W, from
   a16_prepare's scratch, 8 rows a pass over each chunk's weights */
void a16_chunks(const void *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d, const float *m,
                int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1) {
    const int64_t groups = in_features / 32;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o0 = c * CHUNK, n = out_features - o0 < CHUNK ? out_features - o0 : CHUNK;
        for (int64_t r = 0; r < rows; r += A16_ROWS)
            rows_of(w + o0 * groups * 4, d + o0 * groups, m + o0 * groups, groups, (const int8_t *)scratch + r * row_bytes(groups),
                    rows - r < A16_ROWS ? (int)(rows - r) : A16_ROWS, n, out_features, bias ? bias + o0 : 0, out + r * out_features + o0);
    }
}

/* out[rows][O] = x[rows][I] @ W^T (+ bias), 4-bit W, 16-bit activations. scratch: rows * 84 * I / 32 bytes. */
void a16_matmul(const float *x, int64_t rows, int64_t in_features, const uint32_t *w, const float *d, const float *m,
                int64_t out_features, const float *bias, float *out, void *scratch, int threads) {
    const int64_t chunks = chunk_count(out_features);
    a16_prepare(x, rows, in_features, scratch);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, rows, out_features, in_features))
    for (int64_t c = 0; c < chunks; c++)
        a16_chunks(scratch, rows, in_features, w, d, m, out_features, bias, out, c, c + 1);
}

static int use_a16 = -1; /* -1: not yet asked (a benign race: every thread finds the same answer) */

/* Whether the C step may take 16-bit inputs (this CPU has AVX512-VNNI and the compiler knows it, and the
   load check kept them); `allow` 0 says no from now on, 1 yes where they can, -1 only asks. */
int a16_kernels(int allow) {
#ifdef A16
    const int available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                          && __builtin_cpu_supports("avx512vnni");
#else
    const int available = 0;
#endif
    if (allow >= 0 || use_a16 < 0) use_a16 = available && allow != 0;
    return use_a16;
}
