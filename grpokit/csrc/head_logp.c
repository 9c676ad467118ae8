/* Log-probabilities of the sampled tokens from the LM head's logits, and their gradient, in one
 * pass over each row of logits (float32, on the CPU).
 *
 * For rows i of x [n, V] (logits; row stride ld elements), with z = x * inv_t (inv_t = 1 / sampling
 * temperature, > 0) and target t_i:
 *     lse_i  = log sum_j exp(z_ij)
 *     logp_i = z_i,t_i - lse_i
 *     ent_i  = lse_i - sum_j p_ij z_ij,   p_ij = exp(z_ij - lse_i)        (the entropy)
 * and, for the backward pass, in place over x:
 *     x_ij <- inv_t * g_i * ([j == t_i] - p_ij)                          (d sum_i g_i logp_i / d x_ij)
 *
 * PyTorch computes the same with a logsumexp, a gather, a softmax and their backward: about fifteen
 * passes over the [n, V] logits, each of which leaves the core's caches at a 49k-token vocabulary.
 * Here a row (196 KB at V = 49,152) is read from memory once for its maximum and read again from the
 * core's cache for its sums; the backward is one read and one write. Built and loaded by
 * grpokit/cbuild.py; grpokit/train/head.py checks it against PyTorch before using it.
 *
 * The sums run in float vectors flushed into double every 1,024 elements. A row with a NaN or an
 * infinite logit is not computed: its outputs are NaN and it is counted in the return value, so the
 * caller can recompute those rows the way PyTorch does. Rows are split over `threads` threads (the
 * caller's and threads - 1 more).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "threads.h"

#define FLUSH 1024

typedef struct {
    float *x;
    int64_t ld, V;
    const int64_t *tgt;
    float inv_t;
    float *logp, *lse, *ent;
    const float *g;
    int64_t r0, r1;
    int64_t bad;
} job_t;


/* max_j x_j of a row, and whether every entry is finite (x * 0 is 0 for a finite x, NaN otherwise) */
static float row_max(const float *x, int64_t V, int *finite) {
    float m = -INFINITY, probe = 0.f;
    int64_t j = 0;
#if VEC
    __m256 vm = _mm256_set1_ps(-INFINITY), vp = _mm256_setzero_ps();
    const __m256 zero = _mm256_setzero_ps();
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        vm = _mm256_max_ps(vm, v);
        vp = _mm256_add_ps(vp, _mm256_mul_ps(v, zero));
    }
    m = hmax(vm);
    probe = hsum(vp);
#endif
    for (; j < V; j++) {
        m = x[j] > m ? x[j] : m;
        probe += x[j] * 0.f;
    }
    *finite = probe == 0.f;
    return m;
}

static void forward_row(job_t *a, int64_t i) {
    const float *x = a->x + i * a->ld;
    const int64_t V = a->V, t = a->tgt[i];
    const float it = a->inv_t;
    int finite;
    const float mx = row_max(x, V, &finite);
    if (!finite || t < 0 || t >= V) {
        a->logp[i] = a->lse[i] = NAN;
        if (a->ent) a->ent[i] = NAN;
        a->bad++;
        return;
    }
    const float m = mx * it;                                /* max_j z_j (inv_t > 0) */
    double s = 0.0, s1 = 0.0;                               /* sum e^(z-m), sum e^(z-m) (z-m) */
    int64_t j = 0;
#if VEC
    const __m256 vit = _mm256_set1_ps(it), vnm = _mm256_set1_ps(-m), lo = _mm256_set1_ps(-87.3f);
    while (j + 8 <= V) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        const int64_t stop = j + FLUSH < V ? j + FLUSH : V;
        for (; j + 8 <= stop; j += 8) {
            const __m256 d = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), vit, vnm);      /* z - m <= 0 */
            const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), exp_neg(d));
            a0 = _mm256_add_ps(a0, e);
            a1 = _mm256_fmadd_ps(e, d, a1);
        }
        s += hsum(a0);
        s1 += hsum(a1);
    }
#endif
    for (; j < V; j++) {
        const float d = x[j] * it - m;
        const float e = expf(d);
        s += e;
        s1 += (double)e * d;
    }
    const double ls = log(s);
    a->lse[i] = (float)(m + ls);
    a->logp[i] = (float)((double)(x[t] * it) - (m + ls));
    if (a->ent) a->ent[i] = (float)(ls - s1 / s);
}

static void backward_row(job_t *a, int64_t i) {
    float *x = a->x + i * a->ld;
    const int64_t V = a->V, t = a->tgt[i];
    const float gi = a->g[i] * a->inv_t, it = a->inv_t, l = a->lse[i];
    if (gi == 0.f) {                                        /* a padding position: no gradient */
        memset(x, 0, (size_t)V * sizeof(float));
        return;
    }
    int64_t j = 0;
#if VEC
    const __m256 vit = _mm256_set1_ps(it), vnl = _mm256_set1_ps(-l), vng = _mm256_set1_ps(-gi),
                 lo = _mm256_set1_ps(-87.3f);
    for (; j + 8 <= V; j += 8) {
        const __m256 d = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), vit, vnl);          /* log p */
        const __m256 p = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), exp_neg(_mm256_min_ps(d, _mm256_setzero_ps())));
        _mm256_storeu_ps(x + j, _mm256_mul_ps(p, vng));
    }
#endif
    for (; j < V; j++)
        x[j] = -gi * expf(x[j] * it - l);
    if (t >= 0 && t < V) x[t] += gi;
}

static void *run_forward(void *p) {
    job_t *a = (job_t *)p;
    for (int64_t i = a->r0; i < a->r1; i++) forward_row(a, i);
    return NULL;
}

static void *run_backward(void *p) {
    job_t *a = (job_t *)p;
    for (int64_t i = a->r0; i < a->r1; i++) backward_row(a, i);
    return NULL;
}

static int64_t split(job_t base, int64_t n, int threads, void *(*fn)(void *)) {
    job_t jobs[MAX_JOBS];
    threads = job_count(threads, n);
    for (int k = 0; k < threads; k++) {
        jobs[k] = base;
        jobs[k].r0 = n * k / threads;
        jobs[k].r1 = n * (k + 1) / threads;
        jobs[k].bad = 0;
    }
    run_jobs(jobs, sizeof(job_t), threads, fn);
    int64_t bad = 0;
    for (int k = 0; k < threads; k++) bad += jobs[k].bad;
    return bad;
}

/* logp, lse [n] (and ent [n] unless NULL) of the rows of x; returns the number of rows left NaN
   (a non-finite logit or a target outside [0, V)) */
int64_t grpokit_logp_forward(const float *x, int64_t ld, int64_t n, int64_t V, const int64_t *tgt, float inv_t,
                             float *logp, float *lse, float *ent, int threads) {
    job_t base = {(float *)x, ld, V, tgt, inv_t, logp, lse, ent, NULL, 0, 0, 0};
    return split(base, n, threads, run_forward);
}

/* x <- the gradient of sum_i g_i logp_i with respect to x, in place (lse from the forward) */
void grpokit_logp_backward(float *x, int64_t ld, int64_t n, int64_t V, const int64_t *tgt, float inv_t,
                           const float *lse, const float *g, int threads) {
    job_t base = {x, ld, V, tgt, inv_t, NULL, (float *)lse, NULL, g, 0, 0, 0};
    split(base, n, threads, run_backward);
}
