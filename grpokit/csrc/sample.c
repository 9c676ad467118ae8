/* Drawing one token per row from raw logits at a temperature, in one kernel (float32, on the CPU):
 * the sampler's plain path (no top-k, no top-p, no over-confidence resampling).
 *
 * For row i of x [n, V] (row stride ld elements), with z = x * inv_t (inv_t = 1 / temperature > 0)
 * and m the row's largest z (rounded), token j has mass e_j = exp(z_j - m) (exactly 0 for a -inf
 * logit and for z_j - m < -87.3, where float32's exp is below 1e-38), and the drawn token is the first whose
 * cumulative mass exceeds u_i * sum_j e_j: inverse transform sampling at the quantile u_i in [0, 1),
 * as grpokit.rollout.base.inverse_cdf does over PyTorch's softmax. Its log-probability
 * log(e_t / sum_j e_j) is returned with it.
 *
 * The cumulative sums are in double, over blocks of 1,024 tokens: the masses of every block (one
 * pass over the row, after one for its maximum), the block holding the quantile, then the
 * cumulative mass inside that block alone, its masses recomputed by the same code. A row is
 * 196 KB at V = 49,152: read from memory once for its maximum and from the core's cache for the
 * rest. PyTorch's sampler makes eight passes over the [rows, V] logits (a division, a maximum, the
 * softmax's three, a float64 copy for the block sums, a gather): for SmolLM2-135M's logits at 64
 * rows, 5.9 ms at two threads and 10.9 ms at one, against 2.2 and 2.9 ms here (docs/performance.md).
 *
 * A row with a NaN or a +inf logit, or with every logit -inf, has no distribution: it gets token
 * -1 and is counted in the return value (the caller raises). A row the kernel declines (no memory
 * for its sums, or its largest x * inv_t is 2^20 or more) gets token -2 and makes the return value
 * -1: the caller samples with PyTorch. Rows are split over `threads` threads
 * (the caller's and threads - 1 more); each row is computed by one thread in a fixed order, so the
 * result does not depend on the number of threads. Built and loaded by grpokit/cbuild.py;
 * grpokit/rollout/native_sample.py checks it against float64 PyTorch before using it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"
#include "threads.h"

#define BLOCK 1024
#define LOW -87.3f

typedef struct {
    const float *x;
    int64_t ld, V;
    float inv_t;
    const double *u;
    int64_t *tok;
    float *logp;
    int64_t r0, r1;
    int64_t bad, declined;
} job_t;

/* the row's largest logit, and whether it has a distribution: no NaN, no +inf, one logit > -inf */
static float row_max(const float *x, int64_t V, int *ok) {
    float m = -INFINITY;
    int odd = 0;
    int64_t j = 0;
#if VEC
    __m256 vm = _mm256_set1_ps(-INFINITY), vodd = _mm256_setzero_ps();
    const __m256 inf = _mm256_set1_ps(INFINITY);
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        vm = _mm256_max_ps(vm, v);
        vodd = _mm256_or_ps(vodd, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));       /* +inf or NaN */
    }
    m = hmax(vm);
    odd = _mm256_movemask_ps(vodd) != 0;
#endif
    for (; j < V; j++) {
        if (!(x[j] < INFINITY)) odd = 1;
        m = x[j] > m ? x[j] : m;
    }
    *ok = !odd && m > -INFINITY;
    return m;
}

/* e[k] = the mass of token j0 + k, k < j1 - j0: the only place masses are computed, so the block
   sums and the scan inside a block see the same numbers */
static void masses(const float *x, int64_t j0, int64_t j1, float it, float nm, float *e) {
    int64_t j = j0;
#if VEC
    const __m256 vit = _mm256_set1_ps(it), vnm = _mm256_set1_ps(nm), lo = _mm256_set1_ps(LOW);
    for (; j + 8 <= j1; j += 8) {
        const __m256 d = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), vit, vnm);
        _mm256_storeu_ps(e + (j - j0), _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), exp_neg(d)));
    }
#endif
    for (; j < j1; j++) {
        const float d = fmaf(x[j], it, nm);
        e[j - j0] = d >= LOW ? expf(d) : 0.f;
    }
}

static double block_sum(const float *e, int64_t k) {
    double s = 0.0;
    int64_t j = 0;
#if VEC
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; j + 8 <= k; j += 8) {
        const __m256 v = _mm256_loadu_ps(e + j);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(a0, a1));
    s = (t[0] + t[1]) + (t[2] + t[3]);
#endif
    for (; j < k; j++) s += e[j];
    return s;
}

static void sample_row(job_t *a, int64_t i, double *bs) {
    const float *x = a->x + i * a->ld;
    const int64_t V = a->V, nb = (V + BLOCK - 1) / BLOCK;
    const float it = a->inv_t;
    float e[BLOCK];
    int ok;
    const float mx = row_max(x, V, &ok);
    if (!ok) {
        a->tok[i] = -1;
        a->logp[i] = NAN;
        a->bad++;
        return;
    }
    /* m = the largest z, rounded; every mass is e^(z_j - m) with z_j - m exact (one fma), so the
       rounding of m shifts all of them alike and the distribution is exact. The largest z may then
       sit up to half an ulp of m above m: below 2^20, under 0.04, where exp is still exact. Past
       it (z near float's range, a temperature far below the logits' scale) the kernel declines. */
    const float m = mx * it;
    if (!(fabsf(m) < 1048576.f)) {
        a->tok[i] = -2;
        a->declined++;
        return;
    }
    const float nm = -m;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < V ? j0 + BLOCK : V;
        masses(x, j0, j1, it, nm, e);
        bs[b] = block_sum(e, j1 - j0);
        total += bs[b];
    }
    const double target = a->u[i] * total;
    /* the block: the first whose cumulative mass exceeds the target; past the total (rounding of
       u * total), the last block with mass (the row's maximum has mass, so there is one) */
    int64_t b = 0;
    double before = 0.0;
    for (; b < nb; b++) {
        if (before + bs[b] > target) break;
        before += bs[b];
    }
    if (b == nb) {
        for (b = nb - 1; bs[b] <= 0.0; b--) before -= bs[b];
        before -= bs[b];
    }
    const int64_t j0 = b * BLOCK, j1 = j0 + BLOCK < V ? j0 + BLOCK : V;
    masses(x, j0, j1, it, nm, e);
    const double rest = target - before;
    double acc = 0.0;
    int64_t t = -1, last = -1;
    for (int64_t k = 0; k < j1 - j0; k++) {
        if (e[k] > 0.f) {
            last = k;
            acc += e[k];
            if (acc > rest) {
                t = k;
                break;
            }
        }
    }
    if (t < 0) t = last;                   /* the quantile at the block's end, within rounding */
    a->tok[i] = j0 + t;
    a->logp[i] = (float)log((double)e[t] / total);
}

static void *run(void *p) {
    job_t *a = (job_t *)p;
    double *bs = malloc(sizeof(double) * (size_t)((a->V + BLOCK - 1) / BLOCK));
    if (!bs) {
        for (int64_t i = a->r0; i < a->r1; i++) a->tok[i] = -2;      /* no memory: the caller falls back */
        a->declined += a->r1 - a->r0;
        return NULL;
    }
    for (int64_t i = a->r0; i < a->r1; i++) sample_row(a, i, bs);
    free(bs);
    return NULL;
}

/* tok [n] (int64) and logp [n] of the rows of x, drawn at the quantiles u [n]; returns the number of
   rows without a distribution (token -1), or -1 where the kernel declined a row (token -2) */
int64_t grpokit_sample(const float *x, int64_t ld, int64_t n, int64_t V, float inv_t, const double *u,
                       int64_t *tok, float *logp, int threads) {
    job_t jobs[MAX_JOBS];
    threads = job_count(threads, n);
    for (int k = 0; k < threads; k++) {
        job_t j = {x, ld, V, inv_t, u, tok, logp, n * k / threads, n * (k + 1) / threads, 0, 0};
        jobs[k] = j;
    }
    run_jobs(jobs, sizeof(job_t), threads, run);
    int64_t bad = 0, declined = 0;
    for (int k = 0; k < threads; k++) {
        bad += jobs[k].bad;
        declined += jobs[k].declined;
    }
    return declined ? -1 : bad;
}
