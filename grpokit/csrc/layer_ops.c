/* A decoder layer's elementwise blocks as one pass each, forward and backward: RMSNorm, the MLP's
 * SwiGLU gate and the rotary embedding (at the end of this file). grpokit/train/layer_ops.py builds
 * and checks this (float32, CPU).
 *
 * RMSNorm (Zhang & Sennrich 2019), row x [H] with weight w:
 *     r = 1 / sqrt(mean(x^2) + eps),   y = x r w
 *     dx = r (dy w) - x r^3 <dy w, x> / H,   dw += dy x r   (summed over rows)
 * PyTorch's forward is one fused operation, but its backward is about twenty (products, a power,
 * a mean, rsqrt's backward), each a pass over the [tokens, H] activations.
 *
 * SwiGLU (Shazeer 2020), elementwise over the gate g and up u projections, s = sigmoid(g):
 *     y = g s u,   du = dy g s,   dg = dy u s (1 + g (1 - s))
 * PyTorch runs a SiLU and a product forward (saving SiLU's output as well) and three operations
 * backward.
 *
 * Rows (RMSNorm) or elements (SwiGLU) are split over the threads; RMSNorm's weight gradient is
 * summed per job and then over the jobs in their order, so a thread count always gives the same
 * result. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"
#include "threads.h"

int grpokit_layer_ops_supported(void) { return VEC; }

typedef struct {
    const float *x, *w, *dy;
    float *y, *r, *dx, *dw;
    int64_t r0, r1, H;
    float eps;
} rms_job;

static void *rms_fwd_job(void *arg) {
    rms_job *j = (rms_job *)arg;
    const int64_t H = j->H;
    for (int64_t i = j->r0; i < j->r1; i++) {
        const float *x = j->x + i * H;
        float *y = j->y + i * H;
        int64_t c = 0;
        float ss = 0.0f;
#if VEC
        __m256 acc = _mm256_setzero_ps();
        for (; c + 8 <= H; c += 8) {
            __m256 v = _mm256_loadu_ps(x + c);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = hsum(acc);
#endif
        for (; c < H; c++) ss += x[c] * x[c];
        const float r = 1.0f / sqrtf(ss / (float)H + j->eps);
        if (j->r) j->r[i] = r;
        c = 0;
#if VEC
        const __m256 rv = _mm256_set1_ps(r);
        for (; c + 8 <= H; c += 8)
            _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), rv), _mm256_loadu_ps(j->w + c)));
#endif
        for (; c < H; c++) y[c] = x[c] * r * j->w[c];
    }
    return NULL;
}

static void *rms_bwd_job(void *arg) {
    rms_job *j = (rms_job *)arg;
    const int64_t H = j->H;
    const float *w = j->w;
    for (int64_t i = j->r0; i < j->r1; i++) {
        const float *x = j->x + i * H, *dy = j->dy + i * H;
        float *dx = j->dx + i * H;
        const float r = j->r[i];
        int64_t c = 0;
        float dot = 0.0f;
#if VEC
        __m256 acc = _mm256_setzero_ps();
        for (; c + 8 <= H; c += 8)
            acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dy + c), _mm256_loadu_ps(w + c)), _mm256_loadu_ps(x + c), acc);
        dot = hsum(acc);
#endif
        for (; c < H; c++) dot += dy[c] * w[c] * x[c];
        const float k = r * r * r * dot / (float)H;
        c = 0;
#if VEC
        const __m256 rv = _mm256_set1_ps(r), kv = _mm256_set1_ps(k);
        for (; c + 8 <= H; c += 8) {
            const __m256 xv = _mm256_loadu_ps(x + c), gv = _mm256_loadu_ps(dy + c);
            _mm256_storeu_ps(dx + c, _mm256_fnmadd_ps(xv, kv, _mm256_mul_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(w + c)), rv)));
            if (j->dw)
                _mm256_storeu_ps(j->dw + c, _mm256_fmadd_ps(_mm256_mul_ps(gv, xv), rv, _mm256_loadu_ps(j->dw + c)));
        }
#endif
        for (; c < H; c++) {
            dx[c] = dy[c] * w[c] * r - x[c] * k;
            if (j->dw) j->dw[c] += dy[c] * x[c] * r;
        }
    }
    return NULL;
}

/* y [n, H] = RMSNorm(x [n, H]) * w; r [n] (may be NULL) receives each row's 1 / rms */
void grpokit_rms_forward(const float *x, const float *w, int64_t n, int64_t H, float eps, float *y, float *r,
                         int threads) {
    rms_job jobs[MAX_JOBS];
    const int nj = job_count(threads, n);
    for (int t = 0; t < nj; t++)
        jobs[t] = (rms_job){x, w, NULL, y, r, NULL, NULL, n * t / nj, n * (t + 1) / nj, H, eps};
    run_jobs(jobs, sizeof(rms_job), nj, rms_fwd_job);
}

/* dx [n, H] from dy, x, w and the forward's r; dw [H] (may be NULL) = sum over rows of dy x r.
   Returns nonzero when the per-job buffers for dw cannot be allocated. */
int grpokit_rms_backward(const float *x, const float *w, const float *r, const float *dy, int64_t n, int64_t H,
                         float *dx, float *dw, int threads) {
    rms_job jobs[MAX_JOBS];
    const int nj = job_count(threads, n);
    float *buf = NULL;
    if (dw) {
        buf = (float *)calloc((size_t)nj * (size_t)H, sizeof(float));
        if (!buf) return 1;
    }
    for (int t = 0; t < nj; t++)
        jobs[t] = (rms_job){x, w, dy, NULL, (float *)r, dx, buf ? buf + (size_t)t * H : NULL,
                            n * t / nj, n * (t + 1) / nj, H, 0.0f};
    run_jobs(jobs, sizeof(rms_job), nj, rms_bwd_job);
    if (dw) {
        for (int64_t c = 0; c < H; c++) {
            float s = 0.0f;
            for (int t = 0; t < nj; t++) s += buf[(size_t)t * H + c];
            dw[c] = s;
        }
        free(buf);
    }
    return 0;
}

typedef struct {
    const float *g, *u, *dy;
    float *y, *dg, *du;
    int64_t a, b;
} glu_job;

#if VEC
/* sigmoid(g) from e^-|g| (exp_neg's argument stays <= 0) */
static inline __m256 sigmoid8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 neg_abs = _mm256_or_ps(g, _mm256_set1_ps(-0.0f));
    const __m256 e = exp_neg(neg_abs);
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
}
#endif

static inline float sigmoid1(float g) {
    const float e = expf(-fabsf(g));
    return g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

static void *glu_fwd_job(void *arg) {
    glu_job *j = (glu_job *)arg;
    int64_t i = j->a;
#if VEC
    for (; i + 8 <= j->b; i += 8) {
        const __m256 g = _mm256_loadu_ps(j->g + i);
        _mm256_storeu_ps(j->y + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_loadu_ps(j->u + i)));
    }
#endif
    for (; i < j->b; i++) j->y[i] = j->g[i] * sigmoid1(j->g[i]) * j->u[i];
    return NULL;
}

static void *glu_bwd_job(void *arg) {
    glu_job *j = (glu_job *)arg;
    int64_t i = j->a;
#if VEC
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= j->b; i += 8) {
        const __m256 g = _mm256_loadu_ps(j->g + i), u = _mm256_loadu_ps(j->u + i), dy = _mm256_loadu_ps(j->dy + i);
        const __m256 s = sigmoid8(g);
        _mm256_storeu_ps(j->du + i, _mm256_mul_ps(dy, _mm256_mul_ps(g, s)));
        const __m256 ds = _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one);           /* 1 + g (1 - s) */
        _mm256_storeu_ps(j->dg + i, _mm256_mul_ps(_mm256_mul_ps(dy, u), _mm256_mul_ps(s, ds)));
    }
#endif
    for (; i < j->b; i++) {
        const float g = j->g[i], s = sigmoid1(g);
        j->du[i] = j->dy[i] * g * s;
        j->dg[i] = j->dy[i] * j->u[i] * s * (1.0f + g * (1.0f - s));
    }
    return NULL;
}

static void glu_run(glu_job proto, int64_t n, int threads, void *(*fn)(void *)) {
    glu_job jobs[MAX_JOBS];
    const int nj = job_count(threads, (n + 4095) / 4096);          /* at least 4,096 elements a job */
    for (int t = 0; t < nj; t++) {
        jobs[t] = proto;
        jobs[t].a = (n * t / nj) & ~(int64_t)7;
        jobs[t].b = t + 1 == nj ? n : (n * (t + 1) / nj) & ~(int64_t)7;
    }
    run_jobs(jobs, sizeof(glu_job), nj, fn);
}

/* y [n] = g sigmoid(g) u */
void grpokit_swiglu_forward(const float *g, const float *u, int64_t n, float *y, int threads) {
    glu_run((glu_job){g, u, NULL, y, NULL, NULL, 0, 0}, n, threads, glu_fwd_job);
}

/* dg, du [n] from dy [n] */
void grpokit_swiglu_backward(const float *g, const float *u, const float *dy, int64_t n, float *dg, float *du,
                             int threads) {
    glu_run((glu_job){g, u, dy, NULL, dg, du, 0, 0}, n, threads, glu_bwd_job);
}

/* Rotary embedding (Su et al. 2021) in the rotate-half form, x [n, heads, d] with cos, sin [n, d]
 * (a = i, b = i + d/2 for i < d/2):
 *     y_a = x_a cos_a - x_b sin_a,   y_b = x_b cos_b + x_a sin_b
 * and its transpose for the backward:
 *     dx_a = dy_a cos_a + dy_b sin_b,   dx_b = dy_b cos_b - dy_a sin_a
 * PyTorch runs it as a product, a slice, a negation, a concatenation, a product and a sum, each a
 * pass, and as many again backward. */
typedef struct {
    const float *x, *c, *s;
    float *y;
    int64_t t0, t1, heads, d;
    int transpose;
} rope_job;

static void *rope_job_fn(void *arg) {
    rope_job *j = (rope_job *)arg;
    const int64_t d = j->d, half = d / 2;
    for (int64_t t = j->t0; t < j->t1; t++) {
        const float *c = j->c + t * d, *s = j->s + t * d;
        for (int64_t h = 0; h < j->heads; h++) {
            const float *x = j->x + (t * j->heads + h) * d;
            float *y = j->y + (t * j->heads + h) * d;
            int64_t i = 0;
#if VEC
            for (; i + 8 <= half; i += 8) {
                const __m256 xa = _mm256_loadu_ps(x + i), xb = _mm256_loadu_ps(x + half + i);
                const __m256 ca = _mm256_loadu_ps(c + i), cb = _mm256_loadu_ps(c + half + i);
                const __m256 sa = _mm256_loadu_ps(s + i), sb = _mm256_loadu_ps(s + half + i);
                if (!j->transpose) {
                    _mm256_storeu_ps(y + i, _mm256_fnmadd_ps(xb, sa, _mm256_mul_ps(xa, ca)));
                    _mm256_storeu_ps(y + half + i, _mm256_fmadd_ps(xa, sb, _mm256_mul_ps(xb, cb)));
                } else {
                    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(xb, sb, _mm256_mul_ps(xa, ca)));
                    _mm256_storeu_ps(y + half + i, _mm256_fnmadd_ps(xa, sa, _mm256_mul_ps(xb, cb)));
                }
            }
#endif
            for (; i < half; i++) {
                const float xa = x[i], xb = x[half + i];
                if (!j->transpose) {
                    y[i] = xa * c[i] - xb * s[i];
                    y[half + i] = xb * c[half + i] + xa * s[half + i];
                } else {
                    y[i] = xa * c[i] + xb * s[half + i];
                    y[half + i] = xb * c[half + i] - xa * s[i];
                }
            }
        }
    }
    return NULL;
}

/* y = rope(x) (transpose = 0) or its transpose applied to x (1, the backward); d even */
void grpokit_rope(const float *x, const float *c, const float *s, int64_t n, int64_t heads, int64_t d,
                  int transpose, float *y, int threads) {
    rope_job jobs[MAX_JOBS];
    const int nj = job_count(threads, (n * heads * d + 4095) / 4096);
    for (int t = 0; t < nj; t++)
        jobs[t] = (rope_job){x, c, s, y, n * t / nj, n * (t + 1) / nj, heads, d, transpose};
    run_jobs(jobs, sizeof(rope_job), nj, rope_job_fn);
}
