/* Single-query attention over a KV cache, for a decoding step on the CPU (float32).
 *
 * For each row i and KV head g, the r query heads that share g (grouped-query attention: query
 * head h reads KV head h / r) attend over the row's cache:
 *     out[i, h] = sum_j softmax_j(scale * q[i, h] . key_j) value_j
 * where the keys are, in order, the P positions of the row's prompt (kp / vp of prompt pid[i],
 * kept once for the G rows sampled from it; P = 0: none) and the row's own first S positions
 * (k / v), leaving out the prompt positions where pmask is 0 and the row's where mask is 0 (left
 * padding). It is what the decoder's eager path computes with two batched matmuls, a scale and a
 * softmax, in one pass per (row, KV head), with no intermediate tensor: the row's keys and values
 * are read once for its r query heads, and the rows of one prompt, which run one after another,
 * find the prompt's keys still in the core's caches. Built by grpokit/cbuild.py and loaded by
 * grpokit/rollout/native.py, which checks it against the eager computation before using it.
 *
 * Layouts (strides in elements): q[i, h, c] at q + i*q_row + h*d + c; k[i, g, j, c] at
 * k + i*k_row + g*k_head + j*d + c (v, kp, vp alike, kp / vp indexed by prompt); mask[i, j] at
 * mask + i*m_row and pmask[b, j] at pmask + b*pm_row (bytes, NULL: none); out[i, h, c] at
 * out + (i*nh + h)*d + c, nh = nkv*r. The work is split by (row, KV head) over `threads` threads
 * (the caller's and threads-1 more). Returns 0, or -1 when a thread's scratch memory could not be
 * allocated (out is then incomplete: the caller falls back).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"
#include "threads.h"

typedef struct {
    const float *q, *k, *v, *kp, *vp;
    const uint8_t *mask, *pmask;
    const int64_t *pid;
    float *out;
    int64_t q_row, k_row, k_head, v_row, v_head, m_row, kp_row, kp_head, vp_row, vp_head, pm_row;
    int nkv, r, d, S, P;
    float scale;
    int p0, p1;          /* the (row, KV head) pairs p = i*nkv + g in [p0, p1) */
    int status;
} job_t;


/* exp(s[j] - max) in place (masked entries, -INFINITY, come out exactly 0); returns 1 / their sum.
   A NaN or +inf score, or a row with every key masked, gives NaN everywhere, as the eager softmax
   does: the non-finite check on the logits must see it. */
static float softmax_unnormed(float *s, int S) {
    float m = -INFINITY;
    for (int j = 0; j < S; j++)
        m = s[j] > m || s[j] != s[j] ? s[j] : m;           /* a NaN, once seen, stays */
    if (!(m > -INFINITY && m < INFINITY)) {
        for (int j = 0; j < S; j++) s[j] = NAN;
        return NAN;
    }
    float sum = 0.f;
    int j = 0;
#if VEC
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vs = _mm256_setzero_ps();
    for (; j + 8 <= S; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        __m256 e = exp_neg(_mm256_sub_ps(x, vm));
        e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e);
        _mm256_storeu_ps(s + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum(vs);
#endif
    for (; j < S; j++) {
        const float e = s[j] == -INFINITY ? 0.f : expf(s[j] - m);
        s[j] = e;
        sum += e;
    }
    return 1.f / sum;
}

/* sc[j] = scale * Q . K[j] for j < n (keys where M[j] == 0: -INFINITY). Four keys at a time: four
   independent accumulator chains, and one horizontal reduction for the four. */
static void scores(const float *Q, const float *K, const uint8_t *M, int n, int d, float scale, float *sc) {
    int j = 0;
#if VEC
    if ((d & 7) == 0) {
        const __m128 vscale = _mm_set1_ps(scale);
        for (; j + 4 <= n; j += 4) {
            const float *k0 = K + (int64_t)j * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int c = 0; c < d; c += 8) {
                const __m256 qv = _mm256_loadu_ps(Q + c);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a3);
            }
            const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            _mm_storeu_ps(sc + j, _mm_mul_ps(s4, vscale));
        }
    }
#endif
    for (; j < n; j++) {
        const float *kj = K + (int64_t)j * d;
        float a = 0.f;
        for (int c = 0; c < d; c++) a += Q[c] * kj[c];
        sc[j] = a * scale;
    }
    if (M)
        for (j = 0; j < n; j++)
            if (!M[j]) sc[j] = -INFINITY;
}

/* O[c] = inv * (sum_j p1[j] V1[j, c] + sum_j p2[j] V2[j, c]), 64 columns at a time in registers */
static void weigh(const float *V1, const float *p1, int n1, const float *V2, const float *p2, int n2,
                  int d, float inv, float *O) {
    for (int c0 = 0; c0 < d; c0 += 64) {
        const int w = d - c0 < 64 ? d - c0 : 64;
#if VEC
        if ((w & 7) == 0) {
            __m256 acc[8];
            const int nv = w / 8;
            for (int t = 0; t < nv; t++) acc[t] = _mm256_setzero_ps();
            for (int seg = 0; seg < 2; seg++) {
                const float *V = seg ? V2 : V1, *p = seg ? p2 : p1;
                const int n = seg ? n2 : n1;
                for (int j = 0; j < n; j++) {
                    if (p[j] == 0.f) continue;
                    const __m256 pj = _mm256_set1_ps(p[j]);
                    const float *vj = V + (int64_t)j * d + c0;
                    for (int t = 0; t < nv; t++)
                        acc[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * t), acc[t]);
                }
            }
            const __m256 vi = _mm256_set1_ps(inv);
            for (int t = 0; t < nv; t++) _mm256_storeu_ps(O + c0 + 8 * t, _mm256_mul_ps(acc[t], vi));
            continue;
        }
#endif
        float acc[64] = {0};
        for (int seg = 0; seg < 2; seg++) {
            const float *V = seg ? V2 : V1, *p = seg ? p2 : p1;
            const int n = seg ? n2 : n1;
            for (int j = 0; j < n; j++) {
                if (p[j] == 0.f) continue;
                const float *vj = V + (int64_t)j * d + c0;
                for (int c = 0; c < w; c++) acc[c] += p[j] * vj[c];
            }
        }
        for (int c = 0; c < w; c++) O[c0 + c] = acc[c] * inv;
    }
}

static void run(job_t *J) {
    const int r = J->r, d = J->d, S = J->S, P = J->P, nkv = J->nkv;
    float *sc = (float *)malloc(sizeof(float) * (size_t)(P + S > 0 ? P + S : 1));
    if (!sc) { J->status = -1; return; }
    for (int p = J->p0; p < J->p1; p++) {
        const int i = p / nkv, g = p % nkv;
        const float *K = J->k + i * J->k_row + g * J->k_head;
        const float *V = J->v + i * J->v_row + g * J->v_head;
        const uint8_t *M = J->mask ? J->mask + i * J->m_row : NULL;
        const int64_t b = P ? J->pid[i] : 0;
        const float *KP = P ? J->kp + b * J->kp_row + g * J->kp_head : NULL;
        const float *VP = P ? J->vp + b * J->vp_row + g * J->vp_head : NULL;
        const uint8_t *PM = P && J->pmask ? J->pmask + b * J->pm_row : NULL;
        for (int hh = 0; hh < r; hh++) {
            const int h = g * r + hh;
            const float *Q = J->q + i * J->q_row + (int64_t)h * d;
            if (P) scores(Q, KP, PM, P, d, J->scale, sc);
            scores(Q, K, M, S, d, J->scale, sc + P);
            const float inv = softmax_unnormed(sc, P + S);
            weigh(VP, sc, P, V, sc + P, S, d, inv, J->out + ((int64_t)i * nkv * r + h) * d);
        }
    }
    free(sc);
    J->status = 0;
}

static void *run_thread(void *arg) { run((job_t *)arg); return NULL; }

int grpokit_attend(const float *q, int64_t q_row, const float *k, int64_t k_row, int64_t k_head,
                   const float *v, int64_t v_row, int64_t v_head, const uint8_t *mask, int64_t m_row,
                   const float *kp, int64_t kp_row, int64_t kp_head, const float *vp, int64_t vp_row,
                   int64_t vp_head, const uint8_t *pmask, int64_t pm_row, const int64_t *pid, int P,
                   float *out, int n, int nkv, int r, int d, int S, float scale, int threads) {
    const int pairs = n * nkv;
    threads = job_count(threads, pairs);
    job_t jobs[MAX_JOBS];
    int rc = 0;
    for (int t = 0; t < threads; t++) {
        job_t J = {q, k, v, kp, vp, mask, pmask, pid, out, q_row, k_row, k_head, v_row, v_head, m_row,
                   kp_row, kp_head, vp_row, vp_head, pm_row, nkv, r, d, S, P, scale,
                   (int)((int64_t)pairs * t / threads), (int)((int64_t)pairs * (t + 1) / threads), -1};
        jobs[t] = J;
    }
    run_jobs(jobs, sizeof(job_t), threads, run_thread);
    for (int t = 0; t < threads; t++)
        if (jobs[t].status != 0) rc = -1;
    return rc;
}
