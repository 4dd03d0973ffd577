/* A decode step in one call (pc_rag/forward/fused_step.py drives it): every decoder layer of a model
   whose linear layers are pc-rag's blocks (block_kernels.c), one new token per row, over a KVBuffer's
   cache (float32, or 16 bits: kv_kind), each layer as its layer_t describes it (Llama, Qwen3, OLMo 2, Granite, Phi-3, Gemma 2 and 3, SmolLM3:
   forward/llama_step.py's FAMILIES). The same computation as llama_step.py's tensor ops, in the same
   order where order shows (RMSNorm as (offset + weight) * (x * rsqrt(mean(x^2) + eps)), rotate-half
   RoPE as x*cos + roll(x)*signed_sin, softmax attention, gated MLP, residuals); sums are ordered as
   here, so logits agree to float rounding, not bit for bit.

   Why in C: a step of the embedded SmolLM2-135M ran ~2,000 small ATen ops and ~120 kernel calls
   from Python, ~9 ms of a 37 ms step besides the products, and SDPA read the KV at ~6 GB/s. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "block_kernels.h"

typedef struct { /* one linear layer in blocks (pc_rag.weights.blocks.BlockLinear) */
    const void *values;
    const float *scales, *minimums, *bias; /* minimums: 4 bits only; bias may be null */
    int64_t out_features, in_features, bits;
} product_t;

typedef struct { /* one decoder layer: a norm that is null is not there (forward/llama_step.py's _Layer) */
    const float *attention_norm, *mlp_norm;         /* RMSNorm before attention and before the MLP */
    const float *attention_out_norm, *mlp_out_norm; /* RMSNorm of their outputs before the residual (OLMo 2) */
    const float *query_norm, *key_norm;             /* RMSNorm of q and k before RoPE (Qwen3, OLMo 2) */
    float attention_eps, mlp_eps, attention_out_eps, mlp_out_eps, query_key_eps, scaling;
    float residual_scale;                           /* each branch times this into the residual (Granite; else 1) */
    float softcap;                                  /* scores as tanh(s / softcap) * softcap before the mask (Gemma 2; 0: not) */
    int per_head;                                   /* query_norm, key_norm: over each head's dims (1) or all (0) */
    product_t q, k, v, o, gate, up, down;
    /* set each step: */
    void *keys, *values;           /* this layer's [rows, kv_heads, capacity, head_dim] view, in the step's kv_kind */
    const float *cos, *sin;        /* [rows, head_dim]: RoPE at each row's position for this layer, sin's first half negated;
                                      null: the layer turns nothing (SmolLM3's layers without RoPE) */
    const float *mask_add;         /* [rows, entries] added to the scores, or */
    const uint8_t *mask_keep;      /* [rows, entries] 1 = attended, or neither (a layer type's own: Gemma 3's windows) */
} layer_t;

typedef struct { /* module KV that rows read where it is stored, once a step for all of them (RelayAttention) */
    const void *keys, *values;     /* layer 0's keys and values, [kv_heads, entries, head_dim] by the strides below, in kv_kind */
    int64_t entries, layer_stride, head_stride, entry_stride; /* in elements */
    const int64_t *rows;           /* [n_rows] the step's rows that read it */
    int64_t n_rows;
    const float *cos, *sin;        /* [head_dim]: a query rotated back by the part's move (sin's first half negated), or null */
    float score_scale, log_scale;  /* APE: scores times score_scale (1 / temperature), the part's weight times e^log_scale */
} shared_t;

typedef struct {
    layer_t *layers;
    int64_t n_layers, rows, hidden, heads, kv_heads, head_dim, intermediate;
    float *state;                  /* [rows, hidden]: the embeddings in, the final norm's output out */
    const float *final_norm;
    float final_eps;
    float norm_offset;             /* every RMSNorm scales by norm_offset + weight (Gemma: 1) */
    int activation;                /* the MLP's: 0 SiLU, 1 GELU's tanh form */
    int64_t column;                /* the cache entry a row's new key and value are written at */
    int64_t entries;               /* entries attended (the views' length) */
    int64_t capacity;              /* entries the KV storage holds a row's key head (column and entries are within it) */
    int64_t row_stride, head_stride, entry_stride; /* of the KV views, in elements */
    const int64_t *lo, *hi;        /* [rows] entries [lo, hi) attended (lo < 0: a finished row, zeros), or null: all */
    float *work;
    int64_t work_floats;
    int threads;
    product_t head;                /* the LM head in blocks (values null: the caller runs its own) */
    float *logits;                 /* [rows, head.out_features] */
    int activation_bits;           /* 8: products quantize their inputs to 8 bits a block (a8_kernels.c); 16: 4-bit ones
                                      to 16 bits (a16_kernels.c, where a16_kernels() says so); else 32 */
    const shared_t *shared;        /* [n_shared] KV read in place besides the rows' own (queries after all of it: no mask) */
    int64_t n_shared;
    int kv_kind;                   /* what every KV element is (the rows' and the shared parts'): KV_FLOAT32, KV_BFLOAT16, KV_FLOAT16 */
} step_t;

enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 };

/* 8 KV elements from element i of `base` as float32: 16-bit ones widened exactly (bfloat16: the top half of a float32) */
static inline __m256 kv_load8(const void *base, int64_t i, int kind) {
    if (kind == KV_FLOAT32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == KV_FLOAT16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* n float32 values into KV elements from element i of `base`, rounded to nearest even as torch's .to() rounds */
static inline void kv_store(void *base, int64_t i, const float *x, int64_t n, int kind) {
    if (kind == KV_FLOAT32) {
        memcpy((float *)base + i, x, sizeof(float) * n);
        return;
    }
    uint16_t *out = (uint16_t *)base + i;
    int64_t j = 0;
    if (kind == KV_FLOAT16) {
        for (; j + 8 <= n; j += 8)
            _mm_storeu_si128((__m128i *)(out + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
        for (; j < n; j++) out[j] = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x[j]), _MM_FROUND_TO_NEAREST_INT), 0);
        return;
    }
    for (; j < n; j++) {
        uint32_t bits;
        memcpy(&bits, x + j, sizeof bits);
        out[j] = (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((bits >> 16) | 0x40u) /* NaN stays NaN */
                                                     : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

#define MAX_SHARED 4096 /* parts a step reads (their places are on the stack) */

/* e^x, 8 lanes (Cephes' polynomial: ~1 ulp over [-87, 88]; below, ~0 as a masked score must be) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

typedef struct { /* which input the scratch holds prepared, and for which bits (q, k and v share theirs) */
    const float *x;
    int64_t bits;
    void *scratch;
} prepared_t;

typedef struct { /* up to three products of one input (q, k, v; gate, up), their chunks shared out as one part */
    const product_t *p[3];
    float *out[3];
    int64_t first[4]; /* product i's chunks are items [first[i], first[i + 1]) */
    int n, inputs;    /* the activations' bits: 8, 16 or 32 */
    const float *x;
    const void *scratch;
    int64_t rows;
} product_job;

static void product_part(void *context, int64_t start, int64_t stop) {
    const product_job *j = context;
    for (int i = 0; i < j->n; i++) {
        const int64_t c0 = start > j->first[i] ? start : j->first[i], c1 = stop < j->first[i + 1] ? stop : j->first[i + 1];
        if (c0 >= c1) continue;
        const product_t *p = j->p[i];
        const int64_t a = c0 - j->first[i], b = c1 - j->first[i];
        if (p->bits == 8 && j->inputs == 8)
            q8a8_chunks(j->scratch, j->rows, p->in_features, p->values, p->scales, p->out_features, p->bias, j->out[i], a, b);
        else if (p->bits == 8)
            q8_chunks(j->x, j->rows, p->in_features, p->values, p->scales, p->out_features, p->bias, j->out[i], a, b);
        else if (j->inputs == 16)
            a16_chunks(j->scratch, j->rows, p->in_features, p->values, p->scales, p->minimums, p->out_features, p->bias,
                       j->out[i], a, b);
        else if (j->inputs == 8)
            q4a8_chunks(j->scratch, j->rows, p->in_features, p->values, p->scales, p->minimums, p->out_features, p->bias,
                        j->out[i], a, b);
        else
            q4_chunks(j->scratch, j->rows, p->in_features, p->values, p->scales, p->minimums, p->out_features, p->bias,
                      j->out[i], a, b);
    }
}

/* out[i] = x @ W_i^T (+ bias) for n <= 3 products of one input x, the chunks of those at the same bits shared
   among the step's team as one part (k and v alone are three chunks each: two threads would share them 2:1) */
static void products(const step_t *s, int n, const product_t *const *ps, float *const *outs, const float *x, int64_t rows,
                     prepared_t *prepared, int team) {
    const int inputs = s->activation_bits == 8 || (s->activation_bits == 16 && a16_kernels(-1)) ? s->activation_bits : 32;
    for (int i = 0, end; i < n; i = end) {
        for (end = i + 1; end < n && ps[end]->bits == ps[i]->bits;) end++; /* one preparation of x serves [i, end) */
        if ((ps[i]->bits == 4 || inputs == 8) && (prepared->x != x || prepared->bits != ps[i]->bits)) {
            if (inputs == 8) a8_prepare(x, rows, ps[i]->in_features, ps[i]->bits == 4, prepared->scratch);
            else if (inputs == 16) a16_prepare(x, rows, ps[i]->in_features, prepared->scratch);
            else q4_prepare(x, rows, ps[i]->in_features, prepared->scratch);
            prepared->x = x, prepared->bits = ps[i]->bits;
        }
        product_job job = {.n = end - i, .inputs = inputs, .x = x, .scratch = prepared->scratch, .rows = rows};
        for (int k = i; k < end; k++) {
            job.p[k - i] = ps[k], job.out[k - i] = outs[k];
            job.first[k - i + 1] = job.first[k - i] + block_chunks(ps[k]->out_features);
        }
        pool_run(team, job.first[end - i], product_part, &job);
    }
}

static void product(const step_t *s, const product_t *p, const float *x, int64_t rows, float *out, prepared_t *prepared,
                    int team) {
    products(s, 1, &p, &out, x, rows, prepared, team);
}

/* out = (offset + weight) * (x * rsqrt(mean(x^2) + eps)): Llama's weight * (...) where offset is 0, exactly
   (0 + w == w), Gemma's (...) * (1 + w) where it is 1 (a product's factors commute exactly) */
static void rms_norm(const float *x, const float *weight, float offset, float eps, int64_t n, float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = (offset + weight[i]) * (x[i] * inv);
}

/* rotate-half RoPE of each head of x [heads, dim] in place */
static void rotate(float *x, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    float rolled[dim];
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * dim;
        for (int64_t i = 0; i < dim; i++) rolled[i] = xh[(i + half) % dim];
        for (int64_t i = 0; i < dim; i++) xh[i] = xh[i] * cos[i] + rolled[i] * sin[i];
    }
}

/* Gemma 2's soft-capped scores, then the mask: s = tanh(s / cap) * cap (+ mask_add, or -inf where mask_keep is 0), as
   its eager attention computes them; tanh(u) = 1 - 2 / (1 + e^2u), 8 lanes at a time (exp8) */
static void capped_scores(float *scores, int group, int64_t n, int64_t lo, const float *mask_add, const uint8_t *mask_keep,
                          float cap) {
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), by = _mm256_set1_ps(2.f / cap), times = _mm256_set1_ps(cap);
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * n;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(sg + j), by));
            _mm256_storeu_ps(sg + j, _mm256_mul_ps(_mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e))), times));
        }
        for (; j < n; j++) sg[j] = tanhf(sg[j] / cap) * cap;
        for (j = 0; j < n; j++) {
            if (mask_add) sg[j] += mask_add[lo + j];
            else if (mask_keep && !mask_keep[lo + j]) sg[j] = -INFINITY;
        }
    }
}

#define SPAN 256 /* entries of one share of attention: a row's key head's entries are split in spans so that
                     two threads share even one row's three key heads; their partial sums merge in order */

#define KEY_TILE 64 /* entries whose keys stay in L1 while every query head of the group passes over them */

/* scores[g][j] = q_g . k_j * scale + mask for heads of 64: a head's query held in 8 registers while it
   passes over the entries, each score summed as the loop below sums it (a product, 7 FMAs, one reduction) */
static inline __m256 dot64(const __m256 *qv, const void *keys, int64_t k, int kind) {
    __m256 acc = _mm256_mul_ps(qv[0], kv_load8(keys, k, kind));
    for (int u = 1; u < 8; u++) acc = _mm256_fmadd_ps(qv[u], kv_load8(keys, k + 8 * u, kind), acc);
    return acc;
}

static void scores64(const float *q, int group, const void *keys, int64_t base, int kind, int64_t stride, int64_t lo,
                     int64_t n, const float *mask_add, const uint8_t *mask_keep, float scale, float *scores) {
    for (int64_t t = 0; t < n; t += KEY_TILE) {
        const int64_t end = n < t + KEY_TILE ? n : t + KEY_TILE;
        for (int g = 0; g < group; g++) {
            __m256 qv[8];
            for (int u = 0; u < 8; u++) qv[u] = _mm256_loadu_ps(q + g * 64 + 8 * u);
            float *sg = scores + g * n;
            int64_t j = t;
            for (; j + 4 <= end; j += 4) { /* four keys' chains side by side: each score's sum as alone */
                const int64_t k = base + (lo + j) * stride;
                const __m256 a0 = dot64(qv, keys, k, kind), a1 = dot64(qv, keys, k + stride, kind);
                const __m256 a2 = dot64(qv, keys, k + 2 * stride, kind), a3 = dot64(qv, keys, k + 3 * stride, kind);
                sg[j] = hsum(a0) * scale, sg[j + 1] = hsum(a1) * scale, sg[j + 2] = hsum(a2) * scale, sg[j + 3] = hsum(a3) * scale;
            }
            for (; j < end; j++) sg[j] = hsum(dot64(qv, keys, base + (lo + j) * stride, kind)) * scale;
            if (mask_add) for (j = t; j < end; j++) sg[j] += mask_add[lo + j];
            else if (mask_keep) for (j = t; j < end; j++) sg[j] = mask_keep[lo + j] ? sg[j] : -INFINITY;
        }
    }
}

#define VALUE_TILE 32 /* entries whose values stay in L1 while every query head of the group passes over them */

/* heads [g0, g0 + NH) of the group, elements [i0, i0 + 32), over entries [t, end): their sums in 4 registers
   each, every value load serving NH heads */
#define VALUE_HEADS(NH)                                                                                            \
    do {                                                                                                           \
        __m256 acc[NH][4];                                                                                         \
        for (int h = 0; h < NH; h++)                                                                               \
            for (int u = 0; u < 4; u++) acc[h][u] = _mm256_loadu_ps(out + (g0 + h) * dim + i0 + 8 * u);            \
        for (int64_t j = t; j < end; j++) {                                                                        \
            const int64_t v = base + (lo + j) * stride + i0;                                                       \
            __m256 p[NH];                                                                                          \
            for (int h = 0; h < NH; h++) p[h] = _mm256_broadcast_ss(scores + (g0 + h) * n + j);                    \
            for (int u = 0; u < 4; u++) {                                                                          \
                const __m256 x = kv_load8(values, v + 8 * u, kind);                                                \
                for (int h = 0; h < NH; h++) acc[h][u] = _mm256_fmadd_ps(p[h], x, acc[h][u]);                     \
            }                                                                                                      \
        }                                                                                                          \
        for (int h = 0; h < NH; h++)                                                                               \
            for (int u = 0; u < 4; u++) _mm256_storeu_ps(out + (g0 + h) * dim + i0 + 8 * u, acc[h][u]);            \
    } while (0)

/* out[g] += sum_j scores[g][j] * v_j over entries [lo, lo + n): each output element summed over the
   entries in order, one FMA an entry, as a loop over entries, then heads, then elements sums it; the
   sums held in registers over a tile of entries (3 heads x 32 elements at a time), so each value is
   loaded once for 3 heads and no sum is loaded and stored an entry */
static void value_sums(int group, int64_t dim, const void *values, int64_t base, int kind, int64_t stride, int64_t lo,
                       int64_t n, const float *scores, float *out) {
    for (int64_t t = 0; t < n; t += VALUE_TILE) {
        const int64_t end = n < t + VALUE_TILE ? n : t + VALUE_TILE;
        int64_t i0 = 0;
        for (; i0 + 32 <= dim; i0 += 32) {
            int g0 = 0;
            for (; g0 + 3 <= group; g0 += 3) VALUE_HEADS(3);
            if (group - g0 == 2) VALUE_HEADS(2);
            else if (group - g0 == 1) VALUE_HEADS(1);
        }
        for (; i0 < dim; i0 += 8) /* a head size not a multiple of 32: the rest 8 at a time */
            for (int g = 0; g < group; g++) {
                const float *pg = scores + g * n;
                float *og = out + g * dim + i0;
                __m256 a = _mm256_loadu_ps(og);
                for (int64_t j = t; j < end; j++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + j), kv_load8(values, base + (lo + j) * stride + i0, kind), a);
                _mm256_storeu_ps(og, a);
            }
    }
}

/* one span: the `group` query heads of one key head over entries [lo, hi), unnormalized: top[g] the
   largest score (q.K * scale + mask), total[g] = sum_j e^(s_j - top), out[g] = sum_j e^(s_j - top) v_j */
static void attend_span(const float *q, int group, int64_t dim, const void *keys, const void *values, int64_t base, int kind,
                        int64_t stride, int64_t lo, int64_t hi, const float *mask_add, const uint8_t *mask_keep, float scale,
                        float softcap, float *scores, float *out, float *top, float *total) {
    const int64_t n = hi - lo;
    memset(out, 0, sizeof(float) * group * dim);
    for (int g = 0; g < group; g++) top[g] = -INFINITY, total[g] = 0.f;
    if (n <= 0) return;
    const float *const add = mask_add;
    const uint8_t *const keep = mask_keep;
    if (softcap) mask_add = 0, mask_keep = 0; /* capped first, masked after (capped_scores) */
    /* wide_kernels.c: 16 lanes, value sums in registers (float32 KV) */
    const int wide = kind == KV_FLOAT32 && wide_kernels(-1) && wide_span_fits(group, dim);
    if (wide) wide_scores(q, group, (const float *)keys + base, stride, lo, n, mask_add, mask_keep, scale, scores);
    else if (dim == 64) scores64(q, group, keys, base, kind, stride, lo, n, mask_add, mask_keep, scale, scores);
    else for (int64_t j = 0; j < n; j++) {
        const int64_t k = base + (lo + j) * stride;
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qg), kv_load8(keys, k, kind));
            for (int64_t i = 8; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), kv_load8(keys, k + i, kind), acc);
            float score = hsum(acc) * scale;
            if (mask_add) score += mask_add[lo + j];
            else if (mask_keep && !mask_keep[lo + j]) score = -INFINITY;
            scores[g * n + j] = score;
        }
    }
    if (softcap) capped_scores(scores, group, n, lo, add, keep, softcap);
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * n, largest = -INFINITY;
        for (int64_t j = 0; j < n; j++) largest = sg[j] > largest ? sg[j] : largest;
        top[g] = largest;
        if (largest == -INFINITY) { /* nothing attended in this span */
            memset(sg, 0, sizeof(float) * n);
            continue;
        }
        const __m256 shift = _mm256_set1_ps(largest);
        __m256 sum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), shift));
            _mm256_storeu_ps(sg + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        float t = hsum(sum);
        for (; j < n; j++) t += (sg[j] = expf(sg[j] - largest));
        total[g] = t;
    }
    if (wide) wide_values(group, (const float *)values + base, stride, lo, n, scores, out);
    else value_sums(group, dim, values, base, kind, stride, lo, n, scores, out);
}

typedef struct { /* where one shared part's items, partials, queries and scores sit in a step's */
    int64_t first_item, first_partial, first_query, spans;
} place_t;

typedef struct {
    const step_t *s;
    const layer_t *L;
    int64_t layer;
    const float *q;
    float *partial, *scores; /* per (row, key head, span): its group's out, top and total; per item: its scores */
    int64_t spans;           /* of each row's key head in its own entries */
    int64_t own_items;       /* items [0, own_items) are (row, key head, span) of the rows' own entries, the rest shared */
    const place_t *places;   /* [n_shared + 1] */
    float *queries;          /* the shared parts' queries rotated back by their moves */
} attention_job;

static inline int64_t span_floats(const step_t *s) { return (s->heads / s->kv_heads) * (s->head_dim + 2); }
static inline int64_t spans_of(const step_t *s) { return s->entries > 0 ? (s->entries + SPAN - 1) / SPAN : 1; }

/* Each shared part's items ((key head, span), every reading row inside one), partials (one per item and
   reading row) and rotated queries after the rows' own, into places[0..n_shared] (the last: the totals);
   0, or -1 where a part is not one the step reads (too many, no entries, a row outside the step). */
static int place_shared(const step_t *s, place_t *places) {
    if (s->n_shared < 0 || s->n_shared > MAX_SHARED || (s->n_shared && !s->shared)) return -1;
    const int64_t own_items = s->rows * s->kv_heads * spans_of(s);
    place_t at = {own_items, own_items * span_floats(s), 0, 0};
    for (int64_t p = 0; p < s->n_shared; p++) {
        const shared_t *part = s->shared + p;
        if (part->entries < 1 || part->n_rows < 1 || !part->rows || !part->keys || !part->values) return -1;
        for (int64_t i = 0; i < part->n_rows; i++) /* ascending: a row reads a part once (merge_spans counts on it) */
            if (part->rows[i] < (i ? part->rows[i - 1] + 1 : 0) || part->rows[i] >= s->rows) return -1;
        at.spans = (part->entries + SPAN - 1) / SPAN;
        places[p] = at;
        at.first_item += s->kv_heads * at.spans;
        at.first_partial += s->kv_heads * at.spans * part->n_rows * span_floats(s);
        at.first_query += part->cos ? part->n_rows * s->heads * s->head_dim : 0;
    }
    places[s->n_shared] = at;
    return 0;
}

/* a row's query heads over its part: rotated back by the part's move, or the row's own */
static inline const float *part_query(const attention_job *j, int64_t p, int64_t i) {
    const step_t *s = j->s;
    const int64_t qw = s->heads * s->head_dim;
    return s->shared[p].cos ? j->queries + j->places[p].first_query + i * qw : j->q + s->shared[p].rows[i] * qw;
}

/* attention of items [start, stop), unnormalized (merge_spans finishes it): (row, key head, span) of the
   rows' own entries, then (part, key head, span) for every row that reads the part, its keys read once */
static void attention_part(void *context, int64_t start, int64_t stop) {
    const attention_job *j = context;
    const step_t *s = j->s;
    const int64_t D = s->head_dim, qw = s->heads * D, E = s->entries, per = span_floats(s);
    const int group = (int)(s->heads / s->kv_heads);
    for (int64_t item = start; item < stop; item++) {
        float *scores = j->scores + item * group * SPAN;
        if (item < j->own_items) {
            const int64_t span = item % j->spans, pair = item / j->spans, r = pair / s->kv_heads, kh = pair % s->kv_heads;
            const int64_t row_lo = s->lo ? s->lo[r] : 0, row_hi = s->hi && s->hi[r] < E ? s->hi[r] : E; /* never past the entries */
            int64_t lo = 0, hi = 0; /* a finished row (row_lo < 0): nothing */
            if (row_lo >= 0) lo = row_lo + span * SPAN, hi = row_hi < lo + SPAN ? row_hi : lo + SPAN;
            const int64_t base = r * s->row_stride + kh * s->head_stride;
            float *out = j->partial + item * per;
            attend_span(j->q + r * qw + kh * group * D, group, D, j->L->keys, j->L->values, base, s->kv_kind, s->entry_stride, lo, hi,
                        j->L->mask_add ? j->L->mask_add + r * E : 0, j->L->mask_keep ? j->L->mask_keep + r * E : 0, j->L->scaling,
                        j->L->softcap, scores, out, out + group * D, out + group * D + group);
            continue;
        }
        int64_t p = 0;
        while (j->places[p + 1].first_item <= item) p++;
        const shared_t *part = s->shared + p;
        const place_t *place = j->places + p;
        const int64_t local = item - place->first_item, span = local % place->spans, kh = local / place->spans;
        const int64_t lo = span * SPAN, hi = part->entries < lo + SPAN ? part->entries : lo + SPAN;
        const int64_t base = j->layer * part->layer_stride + kh * part->head_stride;
        for (int64_t i = 0; i < part->n_rows; i++) { /* the span stays in cache from one row to the next */
            float *out = j->partial + place->first_partial + ((kh * place->spans + span) * part->n_rows + i) * per;
            float *top = out + group * D;
            attend_span(part_query(j, p, i) + kh * group * D, group, D, part->keys, part->values, base, s->kv_kind,
                        part->entry_stride, lo, hi, 0, 0, j->L->scaling * part->score_scale, j->L->softcap, scores, out, top,
                        top + group);
            if (part->log_scale != 0.f)
                for (int g = 0; g < group; g++) top[g] += part->log_scale; /* -inf stays -inf */
        }
    }
}

/* each (row, key head)'s partials merged: its own spans in order, then each part it reads, span by span:
   softmax over all of them of (q.K * scale + mask) V; nothing attended: zeros, as SDPA gives */
static void merge_spans(const attention_job *j, float *att) {
    const step_t *s = j->s;
    const int64_t D = s->head_dim, per = span_floats(s);
    const int group = (int)(s->heads / s->kv_heads);
    const float *from[j->spans + (j->places[s->n_shared].first_item - j->own_items)]; /* at most every item once */
    for (int64_t pair = 0; pair < s->rows * s->kv_heads; pair++) {
        const int64_t r = pair / s->kv_heads, kh = pair % s->kv_heads;
        int64_t n = 0;
        for (int64_t c = 0; c < j->spans; c++) from[n++] = j->partial + (pair * j->spans + c) * per;
        for (int64_t p = 0; p < s->n_shared; p++) {
            const shared_t *part = s->shared + p;
            const place_t *place = j->places + p;
            for (int64_t i = 0; i < part->n_rows; i++)
                if (part->rows[i] == r)
                    for (int64_t c = 0; c < place->spans; c++)
                        from[n++] = j->partial + place->first_partial + ((kh * place->spans + c) * part->n_rows + i) * per;
        }
        for (int g = 0; g < group; g++) {
            float largest = -INFINITY, total = 0.f;
            for (int64_t c = 0; c < n; c++) largest = from[c][group * D + g] > largest ? from[c][group * D + g] : largest;
            float *out = att + (pair * group + g) * D; /* row r's heads are contiguous: pair * group + g = r * heads + head */
            memset(out, 0, sizeof(float) * D);
            if (largest == -INFINITY) continue;
            for (int64_t c = 0; c < n; c++) {
                const float *part = from[c];
                if (part[group * D + g] == -INFINITY) continue;
                const float weight = expf(part[group * D + g] - largest);
                total += weight * part[group * D + group + g];
                for (int64_t i = 0; i < D; i++) out[i] += weight * part[g * D + i];
            }
            const float norm = 1.f / total;
            for (int64_t i = 0; i < D; i++) out[i] *= norm;
        }
    }
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }

static inline float gelu_tanh(float x) { /* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (1 + e^2u) */
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (2.f - 2.f / (1.f + expf(2.f * u)));
}

/* gate[i] = act(gate[i]) * up[i] (activation 0: SiLU, 1: GELU's tanh form), 8 lanes at a time (exp8): 1,536 of
   them a layer ran scalar expf on the step's first thread while the others spun (~0.7% of its time in a profile
   of the embedded model) */
static void gated(float *gate, const float *up, int64_t n, int activation) {
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f);
    int64_t i = 0;
    if (activation == 1) {
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(gate + i);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, x));
            const __m256 t = _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(one, exp8(_mm256_mul_ps(two, u)))));
            _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), t), _mm256_loadu_ps(up + i)));
        }
        for (; i < n; i++) gate[i] = gelu_tanh(gate[i]) * up[i];
        return;
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(gate + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) gate[i] = silu(gate[i]) * up[i];
}

/* h += branch (normed first where norm is not null, then times scale: exact where it is 1), [rows, hidden] */
static void residual(float *h, float *branch, const float *norm, float offset, float eps, float scale, int64_t rows,
                     int64_t hidden) {
    if (norm)
        for (int64_t r = 0; r < rows; r++) rms_norm(branch + r * hidden, norm, offset, eps, hidden, branch + r * hidden);
    for (int64_t i = 0; i < rows * hidden; i++) h[i] += branch[i] * scale;
}

static inline int64_t widest_input(const step_t *s) { /* of the step's products: hidden, intermediate, heads x dim */
    const int64_t a = s->hidden > s->intermediate ? s->hidden : s->intermediate, b = s->heads * s->head_dim;
    return a > b ? a : b;
}

/* The work floats a step needs (fused_step.py allocates them); -1 where its shared parts are not ones it reads. */
int64_t llama_step_work(const step_t *s) {
    const int64_t qw = s->heads * s->head_dim, kvw = s->kv_heads * s->head_dim, widest = widest_input(s);
    const int64_t per_row = (s->hidden + qw) + s->hidden + 2 * qw + 2 * kvw + 2 * s->intermediate + widest + 2 * widest / 32;
    if (s->kv_heads <= 0 || s->heads % s->kv_heads) return -1;
    place_t places[s->n_shared >= 0 && s->n_shared <= MAX_SHARED ? s->n_shared + 1 : 1];
    if (place_shared(s, places)) return -1;
    const place_t *all = places + s->n_shared; /* items (own and shared) with their scores, partials, rotated queries */
    return s->rows * per_row + all->first_item * (s->heads / s->kv_heads) * SPAN + all->first_partial + all->first_query;
}

/* Every layer of one decode step; 0, -1 when the work buffer is too small or the heads are not ones
   it computes, -2 when the new entry or the entries attended are not within the KV storage. The
   caller checked all of this already (fused_step.py); these are the checks the C can make cheaply. */
int llama_step(const step_t *s) {
    if (s->kv_kind < KV_FLOAT32 || s->kv_kind > KV_FLOAT16) return -1;
    if (s->head_dim % 8 || s->head_dim > 512 || s->kv_heads <= 0 || s->heads % s->kv_heads || s->rows <= 0) return -1;
    const int64_t needed = llama_step_work(s);
    if (needed < 0 || s->work_floats < needed) return -1;
    if (s->column < 0 || s->column >= s->capacity || s->entries < 1 || s->entries > s->capacity) return -2;
    const int64_t R = s->rows, H = s->hidden, D = s->head_dim, F = s->intermediate;
    const int64_t qw = s->heads * D, kvw = s->kv_heads * D;
    const int64_t widest = widest_input(s);
    place_t places[s->n_shared + 1];
    place_shared(s, places);
    float *x = s->work, *q = x + R * (H + qw), *k = q + R * qw, *v = k + R * kvw, *att = v + R * kvw;
    float *tmp = att + R * qw, *gate = tmp + R * H, *up = gate + R * F;
    float *scratch = up + R * F, *scores = scratch + R * (widest + 2 * widest / 32);
    float *partial = scores + places[s->n_shared].first_item * (s->heads / s->kv_heads) * SPAN;
    float *queries = partial + places[s->n_shared].first_partial, *h = s->state;
    const int team = pool_begin(s->threads);
    prepared_t prepared = {0, 0, scratch};
    for (int64_t l = 0; l < s->n_layers; l++) {
        const layer_t *L = s->layers + l;
        const float *in = L->attention_norm ? x : h;
        if (L->attention_norm)
            for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, L->attention_norm, s->norm_offset, L->attention_eps, H, x + r * H);
        prepared.x = 0; /* x is new */
        products(s, 3, (const product_t *[]){&L->q, &L->k, &L->v}, (float *[]){q, k, v}, in, R, &prepared, team);
        if (L->query_norm) { /* in place: rms_norm reads each value before it writes it */
            const int64_t qn = L->per_head ? D : qw, kn = L->per_head ? D : kvw;
            for (int64_t i = 0; i < R * qw; i += qn) rms_norm(q + i, L->query_norm, s->norm_offset, L->query_key_eps, qn, q + i);
            for (int64_t i = 0; i < R * kvw; i += kn) rms_norm(k + i, L->key_norm, s->norm_offset, L->query_key_eps, kn, k + i);
        }
        for (int64_t r = 0; r < R; r++) {
            if (L->cos) {
                rotate(q + r * qw, s->heads, D, L->cos + r * D, L->sin + r * D);
                rotate(k + r * kvw, s->kv_heads, D, L->cos + r * D, L->sin + r * D);
            }
            for (int64_t kh = 0; kh < s->kv_heads; kh++) {
                const int64_t at = r * s->row_stride + kh * s->head_stride + s->column * s->entry_stride;
                kv_store(L->keys, at, k + r * kvw + kh * D, D, s->kv_kind);
                kv_store(L->values, at, v + r * kvw + kh * D, D, s->kv_kind);
            }
        }
        for (int64_t p = 0; p < s->n_shared; p++) /* R(p) q . R(s + d) k == R(p - d) q . R(s) k: moved keys read unrotated */
            if (s->shared[p].cos)
                for (int64_t i = 0; i < s->shared[p].n_rows; i++) {
                    float *moved = queries + places[p].first_query + i * qw;
                    memcpy(moved, q + s->shared[p].rows[i] * qw, sizeof(float) * qw);
                    rotate(moved, s->heads, D, s->shared[p].cos, s->shared[p].sin);
                }
        attention_job job = {s, L, l, q, partial, scores, spans_of(s), R * s->kv_heads * spans_of(s), places, queries};
        pool_run(team, places[s->n_shared].first_item, attention_part, &job);
        merge_spans(&job, att);
        prepared.x = 0; /* att is new */
        product(s, &L->o, att, R, tmp, &prepared, team);
        residual(h, tmp, L->attention_out_norm, s->norm_offset, L->attention_out_eps, L->residual_scale, R, H);
        in = L->mlp_norm ? x : h;
        if (L->mlp_norm)
            for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, L->mlp_norm, s->norm_offset, L->mlp_eps, H, x + r * H);
        prepared.x = 0; /* x is new */
        products(s, 2, (const product_t *[]){&L->gate, &L->up}, (float *[]){gate, up}, in, R, &prepared, team);
        gated(gate, up, R * F, s->activation);
        prepared.x = 0; /* gate is new */
        product(s, &L->down, gate, R, tmp, &prepared, team);
        residual(h, tmp, L->mlp_out_norm, s->norm_offset, L->mlp_out_eps, L->residual_scale, R, H);
    }
    for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, s->final_norm, s->norm_offset, s->final_eps, H, x + r * H);
    memcpy(h, x, sizeof(float) * R * H);
    prepared.x = 0; /* h is new */
    if (s->head.values) product(s, &s->head, h, R, s->logits, &prepared, team);
    if (team > 1) pool_end();
    return 0;
}

/* The layout of the structures above as this compiler laid them out, for the caller to compare with its
   own (fused_step.py's ctypes structures): sizes of product_t, layer_t, step_t and shared_t,
   then each field's offset in declaration order. Returns how many values it wrote (at most `n`). */
int64_t llama_step_layout(int64_t *out, int64_t n) {
#define PUT(value) do { if (written < n) out[written] = (int64_t)(value); written++; } while (0)
    int64_t written = 0;
    PUT(sizeof(product_t)); PUT(sizeof(layer_t)); PUT(sizeof(step_t)); PUT(sizeof(shared_t));
    PUT(offsetof(product_t, values)); PUT(offsetof(product_t, scales)); PUT(offsetof(product_t, minimums));
    PUT(offsetof(product_t, bias)); PUT(offsetof(product_t, out_features)); PUT(offsetof(product_t, in_features));
    PUT(offsetof(product_t, bits));
    PUT(offsetof(layer_t, attention_norm)); PUT(offsetof(layer_t, mlp_norm)); PUT(offsetof(layer_t, attention_out_norm));
    PUT(offsetof(layer_t, mlp_out_norm)); PUT(offsetof(layer_t, query_norm)); PUT(offsetof(layer_t, key_norm));
    PUT(offsetof(layer_t, attention_eps)); PUT(offsetof(layer_t, mlp_eps)); PUT(offsetof(layer_t, attention_out_eps));
    PUT(offsetof(layer_t, mlp_out_eps)); PUT(offsetof(layer_t, query_key_eps)); PUT(offsetof(layer_t, scaling));
    PUT(offsetof(layer_t, residual_scale)); PUT(offsetof(layer_t, softcap)); PUT(offsetof(layer_t, per_head)); PUT(offsetof(layer_t, q)); PUT(offsetof(layer_t, k));
    PUT(offsetof(layer_t, v)); PUT(offsetof(layer_t, o)); PUT(offsetof(layer_t, gate)); PUT(offsetof(layer_t, up));
    PUT(offsetof(layer_t, down)); PUT(offsetof(layer_t, keys)); PUT(offsetof(layer_t, values)); PUT(offsetof(layer_t, cos));
    PUT(offsetof(layer_t, sin)); PUT(offsetof(layer_t, mask_add)); PUT(offsetof(layer_t, mask_keep));
    PUT(offsetof(step_t, layers)); PUT(offsetof(step_t, n_layers)); PUT(offsetof(step_t, rows)); PUT(offsetof(step_t, hidden));
    PUT(offsetof(step_t, heads)); PUT(offsetof(step_t, kv_heads)); PUT(offsetof(step_t, head_dim));
    PUT(offsetof(step_t, intermediate)); PUT(offsetof(step_t, state)); PUT(offsetof(step_t, final_norm));
    PUT(offsetof(step_t, final_eps)); PUT(offsetof(step_t, norm_offset)); PUT(offsetof(step_t, activation));
    PUT(offsetof(step_t, column));
    PUT(offsetof(step_t, entries)); PUT(offsetof(step_t, capacity)); PUT(offsetof(step_t, row_stride));
    PUT(offsetof(step_t, head_stride)); PUT(offsetof(step_t, entry_stride)); PUT(offsetof(step_t, lo)); PUT(offsetof(step_t, hi)); PUT(offsetof(step_t, work));
    PUT(offsetof(step_t, work_floats)); PUT(offsetof(step_t, threads)); PUT(offsetof(step_t, head));
    PUT(offsetof(step_t, logits)); PUT(offsetof(step_t, activation_bits)); PUT(offsetof(step_t, shared));
    PUT(offsetof(step_t, n_shared)); PUT(offsetof(step_t, kv_kind));
    PUT(offsetof(shared_t, keys)); PUT(offsetof(shared_t, values)); PUT(offsetof(shared_t, entries));
    PUT(offsetof(shared_t, layer_stride)); PUT(offsetof(shared_t, head_stride)); PUT(offsetof(shared_t, entry_stride));
    PUT(offsetof(shared_t, rows)); PUT(offsetof(shared_t, n_rows)); PUT(offsetof(shared_t, cos)); PUT(offsetof(shared_t, sin));
    PUT(offsetof(shared_t, score_scale)); PUT(offsetof(shared_t, log_scale));
#undef PUT
    return written;
}

#ifdef PC_RAG_SOURCE_KEY
/* The hash of the sources this library was built from (build.py's source_key): an installed library
   is used only while the sources beside it are the same. */
const char *pc_rag_source_key(void) { return PC_RAG_SOURCE_KEY; }
#endif
