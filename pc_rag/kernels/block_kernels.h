/* What block_kernels.c, a8_kernels.c, wide_kernels.c, a16_kernels.c, llama_step.c and thread_pool.c call of
   each other (pc_rag/kernels/library.py builds the six into one library). */
#ifndef PC_RAG_BLOCK_KERNELS_H
#define PC_RAG_BLOCK_KERNELS_H
#include <immintrin.h>
#include <stdint.h>

/* the sum of 8 lanes */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* How far ahead of its words a one-row 4-bit product asks for weights, marked non-temporal. A
   decode step streams ~170 MB and reads each weight once; asking ahead (which the hardware
   prefetcher did not, over interleaved rows), and keeping the lines out of the caches' long-lived
   part, took the embedded model's C step from 7.7 to 6.7 ms on two threads with AVX-512 and from
   9.2 to 7.8 with AVX2 (A/B, alternating processes). 1-4 KB ahead did alike; T0 in place of NTA,
   and the same for the 8-bit head or the attention's keys and values, gave nothing more. */
#define PREFETCH_BYTES 2048
#define prefetch_weights(words) _mm_prefetch((const char *)(words) + PREFETCH_BYTES, _MM_HINT_NTA)

#define CHUNK 64 /* output features whose weights every input row passes over while they are in cache */
#define PARALLEL_MACS (1 << 20) /* products this large (rows x out x in) run on several threads */

/* how a product is shared out: output features in chunks of CHUNK (their weights stay in cache
   while every input row passes over them), chunks across `threads` OpenMP threads where the product
   is large enough to pay for waking them */
static inline int64_t chunk_count(int64_t out_features) { return (out_features + CHUNK - 1) / CHUNK; }
static inline int parallel(int threads, int64_t rows, int64_t out_features, int64_t in_features) {
    return threads > 1 && rows * out_features * in_features >= PARALLEL_MACS;
}

/* block_kernels.c: products by weights in blocks of 32, a chunk of output features at a time */
int64_t block_chunks(int64_t out_features);
void q4_prepare(const float *x, int64_t rows, int64_t in_features, float *scratch);
void q4_block_sums(const float *x, int64_t groups, float *xs, float *xc);
void q4_chunks(const float *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d,
               const float *m, int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1);
/* a8_kernels.c: the same weights times inputs rounded to 8 bits a block (weights="int4-a8") */
void a8_prepare(const float *x, int64_t rows, int64_t in_features, int interleaved, void *scratch);
void q4a8_chunks(const void *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d,
                 const float *m, int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1);
void q8a8_chunks(const void *scratch, int64_t rows, int64_t in_features, const int8_t *q, const float *d,
                 int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1);
void q8_chunks(const float *x, int64_t rows, int64_t in_features, const int8_t *q, const float *d,
               int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1);

/* wide_kernels.c: AVX-512 forms of block_kernels.c's float-input products, where wide_kernels(-1) says so */
int wide_kernels(int allow);
void wide_prepare(const float *x, int64_t groups, float *xp, float *xs, float *xc);
void wide_q4_rows(const uint32_t *w, const float *d, const float *m, int64_t groups, const float *xp, const float *xs,
                  const float *xc, int rows, int64_t out_features, int64_t out_stride, const float *bias, float *out);
void wide_q8_rows(const int8_t *q, const float *d, int64_t in_features, const float *x, int rows, int64_t n,
                  int64_t out_stride, const float *bias, float *out);
int wide_span_fits(int group, int64_t dim);
void wide_scores(const float *q, int group, const float *keys, int64_t stride, int64_t lo, int64_t n, const float *mask_add,
                 const uint8_t *mask_keep, float scale, float *scores);
void wide_values(int group, const float *values, int64_t stride, int64_t lo, int64_t n, const float *scores, float *out);

/* a16_kernels.c: the same 4-bit weights times inputs rounded to 16 bits a block (the C step, where a16_kernels(-1) says so) */
int a16_kernels(int allow);
void a16_prepare(const float *x, int64_t rows, int64_t in_features, void *scratch);
void a16_chunks(const void *scratch, int64_t rows, int64_t in_features, const uint32_t *w, const float *d, const float *m,
                int64_t out_features, const float *bias, float *out, int64_t c0, int64_t c1);

/* thread_pool.c: the decode step's threads */
typedef void (*part_fn)(void *context, int64_t start, int64_t stop);
int pool_begin(int threads);
void pool_end(void);
void pool_run(int team, int64_t items, part_fn fn, void *context);

#endif
