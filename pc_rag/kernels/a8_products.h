/* The 8-bit-input products of one output feature (a8_kernels.c includes this twice: once for AVX2,
   once for AVX512-VNNI, whose vpdpbusd does maddubs + madd in one instruction; both sum every block
   exactly in int32, so they give the same bits). Before including: A8_NAME(name) (a suffix per
   instruction set), A8_TARGET (a function attribute) and A8_DOT(q, a) (the int32 lanes of a block's
   unsigned-by-signed byte products, summed in fours). */

/* One output feature at a time: its weights are one stream read in order (interleaving 2-4
   features' rows, as the float32-input kernels do, was up to 2x slower here), summed in four
   accumulators so that consecutive blocks' FMAs do not wait on each other. (Summing eight features'
   lanes at once, prefetching features ahead: no faster, measured.) */

/* one output feature of a 4-bit W by one row of 8-bit inputs (interleaved) */
static inline A8_TARGET float A8_NAME(q4a8_one)(const uint32_t *w, const float *d, const float *m, int64_t groups,
                                                const int8_t *a, const float *da, const float *sa) {
    const __m256i shifts = _mm256_set_epi64x(4, 4, 0, 0), low = _mm256_set1_epi8(0x0F);
    const __m256i fix = _mm256_setr_epi32(0, 0, 0, 0, 0x08000000, 0x08000000, 0x08000000, 0x08000000);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t g = 0;
#define A8_BLOCK(acc, k) acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(d + g + k), _mm256_broadcast_ss(da + g + k)), \
        _mm256_cvtepi32_ps(A8_DOT(q4_bytes(w + 4 * (g + k), shifts, low, fix), _mm256_loadu_si256((const __m256i *)(a + 32 * (g + k))))), acc)
    for (; g + 4 <= groups; g += 4) {
        A8_BLOCK(acc0, 0); A8_BLOCK(acc1, 1); A8_BLOCK(acc2, 2); A8_BLOCK(acc3, 3);
    }
    for (; g < groups; g++) A8_BLOCK(acc0, 0);
#undef A8_BLOCK
    return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc2), _mm256_add_ps(acc1, acc3))) + dot(m, sa, groups);
}

/* output features [0, n) of a 4-bit W by one row of 8-bit inputs */
static A8_TARGET void A8_NAME(q4a8_row)(const uint32_t *w, const float *d, const float *m, int64_t groups, const int8_t *a,
                                        const float *da, const float *sa, int64_t n, const float *bias, float *out) {
    for (int64_t o = 0; o < n; o++)
        out[o] = A8_NAME(q4a8_one)(w + o * groups * 4, d + o * groups, m + o * groups, groups, a, da, sa) + (bias ? bias[o] : 0.f);
}

/* one output feature of an 8-bit W by one row of 8-bit inputs (in order): the products take unsigned
   bytes by signed ones, so |w| by a carrying w's sign (llama.cpp's Q8_0 x Q8_0) */
static inline A8_TARGET float A8_NAME(q8a8_one)(const int8_t *q, const float *d, int64_t groups, const int8_t *a,
                                                const float *da) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t g = 0;
#define A8_BLOCK(acc, k) do {                                                                                        \
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * (g + k)));                                     \
        const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a + 32 * (g + k))), w);                \
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(d + g + k), _mm256_broadcast_ss(da + g + k)),           \
                              _mm256_cvtepi32_ps(A8_DOT(_mm256_sign_epi8(w, w), s)), acc);                             \
    } while (0)
    for (; g + 4 <= groups; g += 4) {
        A8_BLOCK(acc0, 0); A8_BLOCK(acc1, 1); A8_BLOCK(acc2, 2); A8_BLOCK(acc3, 3);
    }
    for (; g < groups; g++) A8_BLOCK(acc0, 0);
#undef A8_BLOCK
    return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc2), _mm256_add_ps(acc1, acc3)));
}

/* output features [0, n) of an 8-bit W by one row of 8-bit inputs */
static A8_TARGET void A8_NAME(q8a8_row)(const int8_t *q, const float *d, int64_t in_features, const int8_t *a, const float *da,
                                        int64_t n, const float *bias, float *out) {
    const int64_t groups = in_features / 32;
    for (int64_t o = 0; o < n; o++)
        out[o] = A8_NAME(q8a8_one)(q + o * in_features, d + o * groups, groups, a, da) + (bias ? bias[o] : 0.f);
}
