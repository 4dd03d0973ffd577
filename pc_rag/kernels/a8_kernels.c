/* pc-rag's kernels for weights in blocks of 32 (block_kernels.c's layout) times inputs rounded to 8 bits
   a block, llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 arithmetic: the decode step's products under
   weights="int4-a8" (llama_step.c). Each block of 32 inputs x becomes a = round(x / s), s = max|x| / 127
   (half to even), and y[o] = sum_g d[o][g] * s[g] * (q . a)_g + m[o][g] * s[g] * sum(a)_g: the integer
   dot products are exact, the inputs' rounding (half a step of s) is the only change. A block's 16
   bytes of words read as nibbles give its even-numbered weights (low nibbles) and its odd ones (high
   nibbles), so the inputs are stored evens then odds for 4-bit weights. */
#include "block_kernels.h"

/* x's rows as 8-bit blocks: rows * I int8 (per block evens then odds where `interleaved`, for 4-bit
   weights; else in order, for 8-bit ones), then da[rows][G], sa[rows][G] */
void a8_prepare(const float *x, int64_t rows, int64_t in_features, int interleaved, void *scratch) {
    const int64_t groups = in_features / 32;
    int8_t *a = scratch;
    float *da = (float *)(a + rows * in_features), *sa = da + rows * groups;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < rows * groups; b++) {
        const float *xb = x + 32 * b;
        __m256 top = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * k)));
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        t = _mm_max_ss(t, _mm_movehdup_ps(t));
        const float scale = _mm_cvtss_f32(t) / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
        int32_t q[32]; /* x / scale rounded to nearest even (the default rounding mode) */
        for (int k = 0; k < 4; k++)
            _mm256_storeu_si256((__m256i *)(q + 8 * k), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), _mm256_set1_ps(inverse))));
        int sum = 0;
        int8_t *ab = a + 32 * b;
        for (int j = 0; j < 32; j++) {
            ab[interleaved ? (j & 1) * 16 + j / 2 : j] = (int8_t)q[j];
            sum += q[j];
        }
        da[b] = scale;
        sa[b] = scale * (float)sum;
    }
}

/* a block's 32 nibbles as bytes, evens then odds (the top nibble of each word is stored q ^ 8) */
static inline __m256i q4_bytes(const uint32_t *words, __m256i shifts, __m256i low, __m256i fix) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)words));
    return _mm256_xor_si256(_mm256_and_si256(_mm256_srlv_epi64(b, shifts), low), fix);
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float t = hsum(acc);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* AVX2: maddubs (pairs of unsigned-by-signed byte products, to int16: under 2 * 15 * 127 or 2 * 127 * 127,
   exact) then madd by ones (fours, to int32) */
#define A8_NAME(name) name##_avx2
#define A8_TARGET
#define A8_DOT(q, a) _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1))
#include "a8_products.h"
#undef A8_NAME
#undef A8_TARGET
#undef A8_DOT

#if defined(__clang__) || __GNUC__ >= 8 /* compilers that know AVX512-VNNI */
#define A8_VNNI 1
#define A8_NAME(name) name##_vnni
#define A8_TARGET __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))
#define A8_DOT(q, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a)
#include "a8_products.h"
#undef A8_NAME
#undef A8_TARGET
#undef A8_DOT
#endif

static int use_vnni = -1; /* -1: not yet asked (a benign race: every thread finds the same answer) */

/* Whether the products use AVX512-VNNI (this CPU and compiler have it); `allow` 0 keeps them on AVX2
   (tests compare the two), 1 lets them use it where they can, -1 only asks. */
int a8_vnni(int allow) {
#ifdef A8_VNNI
    const int available = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    const int available = 0;
#endif
    if (allow >= 0 || use_vnni < 0) use_vnni = available && allow != 0;
    return use_vnni;
}

/* chunks [c0, c1) of out[rows][O] = x[rows][I] @ W^T (+ bias), 4-bit W, from a8_prepare's interleaved scratch */
void q4a8_chunks(const void *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d,
                 const float *m, int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1) {
    const int64_t groups = in_features / 32;
    const int8_t *a = scratch;
    const float *da = (const float *)(a + rows * in_features), *sa = da + rows * groups;
    const int vnni = use_vnni < 0 ? a8_vnni(-1) : use_vnni;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o0 = c * CHUNK, n = out_features - o0 < CHUNK ? out_features - o0 : CHUNK;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *ar = a + r * in_features;
            const float *dar = da + r * groups, *sar = sa + r * groups, *bc = bias ? bias + o0 : 0;
            float *oc = out + r * out_features + o0;
#ifdef A8_VNNI
            if (vnni) {
                q4a8_row_vnni(w + o0 * groups * 4, d + o0 * groups, m + o0 * groups, groups, ar, dar, sar, n, bc, oc);
                continue;
            }
#endif
            (void)vnni;
            q4a8_row_avx2(w + o0 * groups * 4, d + o0 * groups, m + o0 * groups, groups, ar, dar, sar, n, bc, oc);
        }
    }
}

/* chunks [c0, c1) of out[rows][O] = x[rows][I] @ W^T (+ bias), 8-bit W, from a8_prepare's in-order scratch */
void q8a8_chunks(const void *scratch, int64_t rows, int64_t in_features, const int8_t *q, const float *d,
                 int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1) {
    const int64_t groups = in_features / 32;
    const int8_t *a = scratch;
    const float *da = (const float *)(a + rows * in_features);
    const int vnni = use_vnni < 0 ? a8_vnni(-1) : use_vnni;
    for (int64_t c = c0; c < c1; c++) {
        const int64_t o0 = c * CHUNK, n = out_features - o0 < CHUNK ? out_features - o0 : CHUNK;
        for (int64_t r = 0; r < rows; r++) {
            const float *bc = bias ? bias + o0 : 0;
            float *oc = out + r * out_features + o0;
#ifdef A8_VNNI
            if (vnni) {
                q8a8_row_vnni(q + o0 * in_features, d + o0 * groups, in_features, a + r * in_features, da + r * groups, n, bc, oc);
                continue;
            }
#endif
            (void)vnni;
            q8a8_row_avx2(q + o0 * in_features, d + o0 * groups, in_features, a + r * in_features, da + r * groups, n, bc, oc);
        }
    }
}

/* out[rows][O] = x[rows][I] @ W^T (+ bias), 4-bit W, 8-bit activations. scratch: rows * (I + 8 * I / 32) bytes. */
void q4a8_matmul(const float *x, int64_t rows, int64_t in_features, const uint32_t *w, const float *d, const float *m,
                 int64_t out_features, const float *bias, float *out, void *scratch, int threads) {
    const int64_t chunks = chunk_count(out_features);
    a8_prepare(x, rows, in_features, 1, scratch);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, rows, out_features, in_features))
    for (int64_t c = 0; c < chunks; c++)
        q4a8_chunks(scratch, rows, in_features, w, d, m, out_features, bias, out, c, c + 1);
}

/* out[rows][O] = x[rows][I] @ W^T (+ bias), 8-bit W, 8-bit activations. scratch: rows * (I + 8 * I / 32) bytes. */
void q8a8_matmul(const float *x, int64_t rows, int64_t in_features, const int8_t *q, const float *d, int64_t out_features,
                 const float *bias, float *out, void *scratch, int threads) {
    const int64_t chunks = chunk_count(out_features);
    a8_prepare(x, rows, in_features, 0, scratch);
    #pragma omp parallel for num_threads(threads) schedule(static) if (parallel(threads, rows, out_features, in_features))
    for (int64_t c = 0; c < chunks; c++)
        q8a8_chunks(scratch, rows, in_features, q, d, out_features, bias, out, c, c + 1);
}
