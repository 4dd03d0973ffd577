/* A Llama-family decode step in one call (pc_rag/model/fused_step.py drives it): every decoder layer
   of a model whose linear layers are pc-rag's blocks (block_kernels.c), one new token per row, over
   a KVBuffer's float32 cache. The same computation as pc_rag/model/llama_step.py's tensor ops, in
   the same order where order shows (RMSNorm as weight * (x * rsqrt(mean(x^2) + eps)), rotate-half
   RoPE as x*cos + roll(x)*signed_sin, softmax attention, SiLU-gated MLP, residuals); sums are
   ordered as here, so logits agree to float rounding, not bit for bit.

   Why in C: a step of the embedded SmolLM2-135M ran ~2,000 small ATen ops and ~120 kernel calls
   from Python, ~9 ms of a 37 ms step besides the products, and SDPA read the KV at ~6 GB/s. */
#include <math.h>
#include <string.h>

#include "block_kernels.h"

typedef struct { /* one linear layer in blocks (pc_rag.model.blocks.BlockLinear) */
    const void *values;
    const float *scales, *minimums, *bias; /* minimums: 4 bits only; bias may be null */
    int64_t out_features, in_features, bits;
} product_t;

typedef struct {
    const float *attention_norm, *mlp_norm;
    float attention_eps, mlp_eps, scaling;
    product_t q, k, v, o, gate, up, down;
    float *keys, *values; /* this layer's [rows, kv_heads, capacity, head_dim] view, set each step */
} layer_t;

typedef struct {
    layer_t *layers;
    int64_t n_layers, rows, hidden, heads, kv_heads, head_dim, intermediate;
    float *state;                  /* [rows, hidden]: the embeddings in, the final norm's output out */
    const float *final_norm;
    float final_eps;
    const float *cos, *sin;        /* [rows, head_dim]: RoPE at each row's position, sin's first half negated */
    int64_t column;                /* the cache entry a row's new key and value are written at */
    int64_t entries;               /* entries attended (the views' length) */
    int64_t row_stride, head_stride, entry_stride; /* of the KV views, in floats */
    const float *mask_add;         /* [rows, entries] added to the scores, or */
    const uint8_t *mask_keep;      /* [rows, entries] 1 = attended, or neither */
    const int64_t *lo, *hi;        /* [rows] entries [lo, hi) attended (lo < 0: a finished row, zeros), or null: all */
    float *work;
    int64_t work_floats;
    int threads;
    product_t head;                /* the LM head in blocks (values null: the caller runs its own) */
    float *logits;                 /* [rows, head.out_features] */
} step_t;

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

typedef struct {
    const product_t *p;
    const float *x, *scratch; /* the input, and as q4_prepare left it */
    int64_t rows;
    float *out;
} product_job;

static void product_part(void *context, int64_t start, int64_t stop) {
    const product_job *j = context;
    const product_t *p = j->p;
    if (p->bits == 4)
        q4_chunks(j->scratch, j->rows, p->in_features, p->values, p->scales, p->minimums, p->out_features, p->bias, j->out,
                  start, stop);
    else
        q8_chunks(j->x, j->rows, p->in_features, p->values, p->scales, p->out_features, p->bias, j->out, start, stop);
}

/* out = x @ W^T (+ bias), its chunks of output features shared among the step's team */
static void product(const product_t *p, const float *x, int64_t rows, float *out, float *scratch, int team) {
    if (p->bits == 4) q4_prepare(x, rows, p->in_features, scratch);
    product_job job = {p, x, scratch, rows, out};
    pool_run(team, block_chunks(p->out_features), product_part, &job);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)) */
static void rms_norm(const float *x, const float *weight, float eps, int64_t n, float *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
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

/* the `group` query heads of one key head over entries [lo, hi): softmax(q.K * scale + mask) V */
static void attend(const float *q, int group, int64_t dim, const float *keys, const float *values, int64_t stride,
                   int64_t lo, int64_t hi, const float *mask_add, const uint8_t *mask_keep, float scale, float *scores,
                   float *out) {
    const int64_t n = hi - lo;
    memset(out, 0, sizeof(float) * group * dim);
    if (n <= 0) return;
    for (int64_t j = 0; j < n; j++) {
        const float *k = keys + (lo + j) * stride;
        for (int g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
            for (int64_t i = 8; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(k + i), acc);
            float s = hsum(acc) * scale;
            if (mask_add) s += mask_add[lo + j];
            else if (mask_keep && !mask_keep[lo + j]) s = -INFINITY;
            scores[g * n + j] = s;
        }
    }
    for (int g = 0; g < group; g++) {
        float *sg = scores + g * n, top = -INFINITY, total = 0.f;
        for (int64_t j = 0; j < n; j++) top = sg[j] > top ? sg[j] : top;
        if (top == -INFINITY) { /* nothing attended: zeros, as SDPA gives */
            memset(sg, 0, sizeof(float) * n);
            continue;
        }
        const __m256 shift = _mm256_set1_ps(top);
        __m256 sum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), shift));
            _mm256_storeu_ps(sg + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        total = hsum(sum);
        for (; j < n; j++) total += (sg[j] = expf(sg[j] - top));
        const float norm = 1.f / total;
        for (j = 0; j < n; j++) sg[j] *= norm;
    }
    for (int64_t j = 0; j < n; j++) {
        const float *v = values + (lo + j) * stride;
        for (int g = 0; g < group; g++) {
            const __m256 p = _mm256_broadcast_ss(scores + g * n + j);
            float *og = out + g * dim;
            for (int64_t i = 0; i < dim; i += 8)
                _mm256_storeu_ps(og + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + i), _mm256_loadu_ps(og + i)));
        }
    }
}

typedef struct {
    const step_t *s;
    const layer_t *L;
    const float *q;
    float *att, *scores;
} attention_job;

/* attention of (row, key head) pairs [start, stop) */
static void attention_part(void *context, int64_t start, int64_t stop) {
    const attention_job *j = context;
    const step_t *s = j->s;
    const int64_t D = s->head_dim, qw = s->heads * D, E = s->entries;
    const int group = (int)(s->heads / s->kv_heads);
    for (int64_t pair = start; pair < stop; pair++) {
        const int64_t r = pair / s->kv_heads, kh = pair % s->kv_heads;
        const int64_t lo = s->lo ? s->lo[r] : 0, hi = s->hi ? s->hi[r] : E;
        const int64_t base = r * s->row_stride + kh * s->head_stride;
        float *out = j->att + r * qw + kh * group * D;
        if (lo < 0) {
            memset(out, 0, sizeof(float) * group * D);
            continue;
        }
        attend(j->q + r * qw + kh * group * D, group, D, j->L->keys + base, j->L->values + base, s->entry_stride, lo, hi,
               s->mask_add ? s->mask_add + r * E : 0, s->mask_keep ? s->mask_keep + r * E : 0, j->L->scaling,
               j->scores + (r * s->kv_heads + kh) * group * E, out);
    }
}

static inline float silu(float x) { return x / (1.f + expf(-x)); }

static inline int64_t widest_input(const step_t *s) { /* of the step's products: hidden, intermediate, heads x dim */
    const int64_t a = s->hidden > s->intermediate ? s->hidden : s->intermediate, b = s->heads * s->head_dim;
    return a > b ? a : b;
}

/* The work floats a step needs (fused_step.py allocates them). */
int64_t llama_step_work(const step_t *s) {
    const int64_t qw = s->heads * s->head_dim, kvw = s->kv_heads * s->head_dim, widest = widest_input(s);
    const int64_t per_row = (s->hidden + qw) + s->hidden + 2 * qw + 2 * kvw + 2 * s->intermediate + widest + 2 * widest / 32;
    return s->rows * (per_row + s->heads * s->entries);
}

/* Every layer of one decode step; 0, or -1 when the work buffer is too small. */
int llama_step(const step_t *s) {
    if (s->work_floats < llama_step_work(s) || s->head_dim % 8 || s->head_dim > 512) return -1;
    const int64_t R = s->rows, H = s->hidden, D = s->head_dim, F = s->intermediate;
    const int64_t qw = s->heads * D, kvw = s->kv_heads * D;
    const int64_t widest = widest_input(s);
    float *x = s->work, *q = x + R * (H + qw), *k = q + R * qw, *v = k + R * kvw, *att = v + R * kvw;
    float *tmp = att + R * qw, *gate = tmp + R * H, *up = gate + R * F;
    float *scratch = up + R * F, *scores = scratch + R * (widest + 2 * widest / 32);
    float *h = s->state;
    const int team = pool_begin(s->threads);
    for (int64_t l = 0; l < s->n_layers; l++) {
        const layer_t *L = s->layers + l;
        for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, L->attention_norm, L->attention_eps, H, x + r * H);
        product(&L->q, x, R, q, scratch, team);
        product(&L->k, x, R, k, scratch, team);
        product(&L->v, x, R, v, scratch, team);
        for (int64_t r = 0; r < R; r++) {
            rotate(q + r * qw, s->heads, D, s->cos + r * D, s->sin + r * D);
            rotate(k + r * kvw, s->kv_heads, D, s->cos + r * D, s->sin + r * D);
            for (int64_t kh = 0; kh < s->kv_heads; kh++) {
                const int64_t at = r * s->row_stride + kh * s->head_stride + s->column * s->entry_stride;
                memcpy(L->keys + at, k + r * kvw + kh * D, sizeof(float) * D);
                memcpy(L->values + at, v + r * kvw + kh * D, sizeof(float) * D);
            }
        }
        attention_job job = {s, L, q, att, scores};
        pool_run(team, R * s->kv_heads, attention_part, &job);
        product(&L->o, att, R, tmp, scratch, team);
        for (int64_t i = 0; i < R * H; i++) h[i] += tmp[i];
        for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, L->mlp_norm, L->mlp_eps, H, x + r * H);
        product(&L->gate, x, R, gate, scratch, team);
        product(&L->up, x, R, up, scratch, team);
        for (int64_t i = 0; i < R * F; i++) gate[i] = silu(gate[i]) * up[i];
        product(&L->down, gate, R, tmp, scratch, team);
        for (int64_t i = 0; i < R * H; i++) h[i] += tmp[i];
    }
    for (int64_t r = 0; r < R; r++) rms_norm(h + r * H, s->final_norm, s->final_eps, H, x + r * H);
    memcpy(h, x, sizeof(float) * R * H);
    if (s->head.values) product(&s->head, h, R, s->logits, scratch, team);
    if (team > 1) pool_end();
    return 0;
}
