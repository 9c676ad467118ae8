/* Attention over packed tokens for the training forward (grpokit/train/forward.py), float32,
 * forward and backward, in tiles.
 *
 * The N tokens of a micro-batch are packed (no padding): each distinct prompt's real tokens, then
 * each row's completion tokens. Token t attends to the keys in [a0[t], a1[t]) (its prompt's real
 * tokens, for a completion token; empty for a prompt token) and, causally, to [b0[t], t] (its own
 * sequence's tokens up to itself). Query head h reads KV head h / r (grouped-query attention).
 *
 *   forward:  o[t, h] = sum_j softmax_j(scale q[t, h] . k[j, g]) v[j, g],  lse[t, h] = log sum_j e^s
 *   backward: with D[t, h] = do[t, h] . o[t, h], p = e^(s - lse), ds = p (do . v[j] - D):
 *             dq[t] = scale sum_j ds k[j];  dk[j] = scale sum_t ds q[t];  dv[j] = sum_t p do[t]
 *
 * Work goes in tiles of up to QT = 12 (query, head) pairs of one KV head against blocks of 8 keys,
 * as small matrix products: each key's values are loaded once for the 12 pairs (from kt / vt, the
 * keys and values transposed per KV head, [nkv, d, N + 8]), and each query's once for 8 keys.
 * The forward runs over query tiles (start, count of consecutive tokens of one sequence). The
 * backward is one pass over key tiles (start, count of up to 8 consecutive keys of one sequence),
 * each visiting the queries that attend to its keys: its own sequence's later tokens up to e[j]
 * and, for a prompt's keys (u[j] >= 0), every completion row of that prompt, the token ranges
 * rows[rs[u] .. rs[u + 1]) (pairs of start, end). A tile writes its keys' dk and dv alone; dq goes
 * into a buffer of each thread's own, summed in thread order at the end (so a thread count
 * always gives the same result).
 *
 * Layouts (elements, each token's heads contiguous): q, o, dq, do [N, nh, d]; k, v, dk, dv
 * [N, nkv, d]; lse, D [N, nh]. d a multiple of 8. Returns 0, or -1 when scratch memory could not
 * be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "threads.h"

#if !VEC
/* no AVX2 + FMA: no kernel (grpokit/train/packed_attention.py then keeps PyTorch's attention) */
int grpokit_packed_supported(void) { return 0; }
int grpokit_packed_forward(void) { return -1; }
int grpokit_packed_backward(void) { return -1; }
#else
int grpokit_packed_supported(void) { return 1; }

#define QT 12

/* S[x, jb .. jb + 8) = sum_c P[x][c] KT[c, j0 + jb ..] for x < QT, over n keys from j0 (rounded up
   to 8; kt holds 8 columns past the last key) */
static void tile_scores(const float *const *P, const float *KT, int64_t ld, int64_t j0, int n, int d,
                        float *S, int ldS, float mul) {
    const __m256 vm = _mm256_set1_ps(mul);
    for (int jb = 0; jb < n; jb += 8) {
        __m256 a[QT];
        for (int x = 0; x < QT; x++) a[x] = _mm256_setzero_ps();
        const float *kc = KT + j0 + jb;
        for (int c = 0; c < d; c++, kc += ld) {
            const __m256 kv = _mm256_loadu_ps(kc);
            for (int x = 0; x < QT; x++) a[x] = _mm256_fmadd_ps(_mm256_broadcast_ss(P[x] + c), kv, a[x]);
        }
        for (int x = 0; x < QT; x++) _mm256_storeu_ps(S + x * ldS + jb, _mm256_mul_ps(a[x], vm));
    }
}

/* O[x][cb..cb+8) (+)= sum_j W[x * ldW + j] Y[(j0 + j) * ys + cb ..] for x < QT, j < n */
static void tile_weigh(const float *W, int ldW, const float *Y, int64_t ys, int64_t j0, int n, int d,
                       float *const *O, int add, const float *fac) {
    for (int cb = 0; cb < d; cb += 8) {
        __m256 a[QT];
        for (int x = 0; x < QT; x++) a[x] = add ? _mm256_loadu_ps(O[x] + cb) : _mm256_setzero_ps();
        const float *y = Y + j0 * ys + cb;
        for (int j = 0; j < n; j++, y += ys) {
            const __m256 yv = _mm256_loadu_ps(y);
            for (int x = 0; x < QT; x++) a[x] = _mm256_fmadd_ps(_mm256_broadcast_ss(W + x * ldW + j), yv, a[x]);
        }
        if (fac)
            for (int x = 0; x < QT; x++) a[x] = _mm256_mul_ps(a[x], _mm256_set1_ps(fac[x]));
        for (int x = 0; x < QT; x++) _mm256_storeu_ps(O[x] + cb, a[x]);
    }
}

/* the largest of s[0 .. n) (a NaN, once seen, stays) */
static float row_max(const float *s, int n) {
    int j = 0;
    float m = -INFINITY;
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(s), nan = _mm256_setzero_ps();
        for (j = 8; j + 8 <= n; j += 8) {
            const __m256 x = _mm256_loadu_ps(s + j);
            vm = _mm256_max_ps(vm, x);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        }
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(vm, vm, _CMP_UNORD_Q));
        if (_mm256_movemask_ps(nan)) return NAN;
        m = hmax(vm);
    }
    for (; j < n; j++) m = s[j] > m || s[j] != s[j] ? s[j] : m;
    return m;
}

/* e^(x[j] - m) for j < n, in place; returns their sum */
static float exps(float *x, int n, float m) {
    float sum = 0.f;
    int j = 0;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        _mm256_storeu_ps(x + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = hsum(vs);
    for (; j < n; j++) {
        x[j] = expf(x[j] - m);
        sum += x[j];
    }
    return sum;
}

typedef struct {
    const float *q, *k, *v, *kt, *vt, *dO, *lse, *D;
    float *out, *out_lse, *g1, *g2, *dqb;       /* dqb: this job's own dq, summed after */
    const int64_t *a0, *a1, *b0, *e, *u, *rs, *rows, *tiles;
    int64_t N, ntiles;
    int nkv, r, d, which, job, jobs, status;   /* which: 0 forward, 1 backward */
    float scale;
} job_t;

/* the forward of a query tile: nt consecutive tokens from t0 of one sequence, KV head g */
static void run_query_tile(const job_t *J, int64_t t0, int nt, int g, float *S, int ldS,
                           const float *zero, float *scratch) {
    const int d = J->d, r = J->r, nh = J->nkv * r;
    const int64_t qs = (int64_t)nh * d, ks = (int64_t)J->nkv * d, ld = J->N + 8;
    const int64_t a0 = J->a0[t0], n1 = J->a1[t0] - a0, b0 = J->b0[t0];
    const int n2 = (int)(t0 + nt - b0), n = (int)n1 + n2;
    const float *KT = J->kt + (int64_t)g * d * ld, *V = J->v + (int64_t)g * d;
    for (int p0 = 0; p0 < nt * r; p0 += QT) {          /* (token, head) pairs in chunks of QT */
        const float *qp[QT];
        float *op[QT], fac[QT];
        int tt[QT], hh[QT], m = 0;
        for (int x = 0; x < QT; x++) {                  /* pairs past the last: zero queries */
            const int pr = p0 + x;
            if (pr < nt * r) {
                tt[x] = pr / r; hh[x] = g * r + pr % r; m = x + 1;
                qp[x] = J->q + (t0 + tt[x]) * qs + (int64_t)hh[x] * d;
                op[x] = J->out + (t0 + tt[x]) * qs + (int64_t)hh[x] * d;
            } else {
                tt[x] = -1; hh[x] = 0; qp[x] = zero; op[x] = scratch + x * d;
            }
        }
        if (n1) tile_scores(qp, KT, ld, a0, (int)n1, d, S, ldS, J->scale);
        tile_scores(qp, KT, ld, b0, n2, d, S + n1, ldS, J->scale);
        for (int x = 0; x < QT; x++) {
            float *s = S + x * ldS;
            fac[x] = 1.f;
            if (x >= m) { memset(s, 0, sizeof(float) * (size_t)n); continue; }
            const int valid = (int)n1 + (int)(t0 + tt[x] - b0) + 1;   /* later own tokens: masked */
            const float mx = row_max(s, valid);
            const float sum = exps(s, valid, mx);
            fac[x] = 1.f / sum;
            J->out_lse[(t0 + tt[x]) * nh + hh[x]] = mx + logf(sum);
            for (int j = valid; j < n; j++) s[j] = 0.f;
        }
        if (n1) tile_weigh(S, ldS, V, ks, a0, (int)n1, d, op, 0, NULL);
        tile_weigh(S + n1, ldS, V, ks, b0, n2, d, op, n1 > 0, fac);
    }
}

static void run_key_tile(const job_t *J, int64_t j0, int nk, int g, float *S, float *S2,
                         const float *zero, float *acc) {
    const int d = J->d, r = J->r, nh = J->nkv * r;
    const int64_t qs = (int64_t)nh * d, ks = (int64_t)J->nkv * d, ld = J->N + 8;
    const float *KT = J->kt + (int64_t)g * d * ld, *VT = J->vt + (int64_t)g * d * ld;
    float *dk = acc, *dv = acc + 8 * d;
    memset(acc, 0, sizeof(float) * 16 * (size_t)d);
    const int64_t uj = J->u[j0];
    const int64_t nruns = 1 + (uj >= 0 ? J->rs[uj + 1] - J->rs[uj] : 0);
    /* the attending (token, head) pairs, run by run, in chunks of QT */
    for (int64_t xr = 0; xr < nruns; xr++) {
        const int64_t t0 = xr == 0 ? j0 : J->rows[2 * (J->rs[uj] + xr - 1)];
        const int64_t t1 = xr == 0 ? J->e[j0] : J->rows[2 * (J->rs[uj] + xr - 1) + 1];
        const int own = xr == 0;
        const int64_t npairs = (t1 - t0) * r;
        for (int64_t p0 = 0; p0 < npairs; p0 += QT) {
            const float *qp[QT], *dp[QT];
            int64_t tt[QT];
            int hh[QT], m = 0;
            for (int x = 0; x < QT; x++) {
                const int64_t pr = p0 + x;
                if (pr < npairs) {
                    tt[x] = t0 + pr / r; hh[x] = g * r + (int)(pr % r); m = x + 1;
                    qp[x] = J->q + tt[x] * qs + (int64_t)hh[x] * d;
                    dp[x] = J->dO + tt[x] * qs + (int64_t)hh[x] * d;
                } else {
                    tt[x] = -1; hh[x] = 0; qp[x] = dp[x] = zero;
                }
            }
            tile_scores(qp, KT, ld, j0, 8, d, S, 8, J->scale);   /* S[x][jj], 8 keys */
            tile_scores(dp, VT, ld, j0, 8, d, S2, 8, 1.f);
            for (int x = 0; x < QT; x++) {
                float *s = S + x * 8, *s2 = S2 + x * 8;
                if (x >= m) { for (int jj = 0; jj < 8; jj++) s[jj] = s2[jj] = 0.f; continue; }
                const int64_t li = tt[x] * nh + hh[x];
                int64_t lim = own ? tt[x] - j0 + 1 : 8;     /* keys j0 + jj, jj < lim, attended */
                if (lim > nk) lim = nk;
                const __m256 ok = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_ps((float)lim), _CMP_LT_OQ);
                const __m256 arg = _mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(s), _mm256_set1_ps(J->lse[li])),
                                                 _mm256_setzero_ps());
                const __m256 p = _mm256_and_ps(exp_neg(arg), ok);
                const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(s2),
                                                _mm256_set1_ps(J->D[li]))), _mm256_set1_ps(J->scale));
                _mm256_storeu_ps(s, p);
                _mm256_storeu_ps(s2, ds);
            }
            /* dv[jj] += sum_x p[x][jj] do[x]; dk[jj] += sum_x ds[x][jj] q[x]: 8 keys in registers */
            for (int cb = 0; cb < d; cb += 8) {
                __m256 av[8], ak[8];
                for (int jj = 0; jj < 8; jj++) {
                    av[jj] = _mm256_loadu_ps(dv + jj * d + cb);
                }
                for (int x = 0; x < m; x++) {
                    const __m256 dov = _mm256_loadu_ps(dp[x] + cb);
                    for (int jj = 0; jj < 8; jj++) av[jj] = _mm256_fmadd_ps(_mm256_broadcast_ss(S + x * 8 + jj), dov, av[jj]);
                }
                for (int jj = 0; jj < 8; jj++) _mm256_storeu_ps(dv + jj * d + cb, av[jj]);
                for (int jj = 0; jj < 8; jj++) ak[jj] = _mm256_loadu_ps(dk + jj * d + cb);
                for (int x = 0; x < m; x++) {
                    const __m256 qv = _mm256_loadu_ps(qp[x] + cb);
                    for (int jj = 0; jj < 8; jj++) ak[jj] = _mm256_fmadd_ps(_mm256_broadcast_ss(S2 + x * 8 + jj), qv, ak[jj]);
                }
                for (int jj = 0; jj < 8; jj++) _mm256_storeu_ps(dk + jj * d + cb, ak[jj]);
                /* dq[x] += sum_jj ds[x][jj] k[jj]: the tile's keys in registers */
                const float *kr = J->k + j0 * ks + (int64_t)g * d + cb;
                for (int jj = 0; jj < 8; jj++) ak[jj] = jj < nk ? _mm256_loadu_ps(kr + jj * ks) : _mm256_setzero_ps();
                for (int x = 0; x < m; x++) {
                    float *dqx = J->dqb + tt[x] * qs + (int64_t)hh[x] * d + cb;
                    __m256 a = _mm256_loadu_ps(dqx);
                    for (int jj = 0; jj < 8; jj++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(S2 + x * 8 + jj), ak[jj], a);
                    _mm256_storeu_ps(dqx, a);
                }
            }
        }
    }
    for (int jj = 0; jj < nk; jj++) {
        memcpy(J->g1 + (j0 + jj) * ks + (int64_t)g * d, dk + jj * d, sizeof(float) * (size_t)d);
        memcpy(J->g2 + (j0 + jj) * ks + (int64_t)g * d, dv + jj * d, sizeof(float) * (size_t)d);
    }
}

static void run(job_t *J) {
    const int d = J->d, ldS = (int)(J->N + 16);
    float *S = (float *)malloc(sizeof(float) * (size_t)(2 * QT * ldS + QT * d + 16 * d + d));
    if (!S) { J->status = -1; return; }
    float *S2 = S + QT * ldS, *scratch = S2 + QT * ldS, *acc = scratch + QT * d, *zero = acc + 16 * d;
    memset(zero, 0, sizeof(float) * (size_t)d);
    const int64_t items = J->ntiles * J->nkv;
    for (int64_t it = J->job; it < items; it += J->jobs) {
        const int64_t tile = it / J->nkv;
        const int g = (int)(it % J->nkv);
        const int64_t t0 = J->tiles[2 * tile];
        const int nt = (int)J->tiles[2 * tile + 1];
        if (J->which == 0) run_query_tile(J, t0, nt, g, S, ldS, zero, scratch);
        else run_key_tile(J, t0, nt, g, S, S2, zero, acc);
    }
    free(S);
    J->status = 0;
}

static void *run_thread(void *arg) { run((job_t *)arg); return NULL; }

/* run proto's tiles on up to `threads` jobs; dqb, when given, holds each job's own nq floats (zeroed) */
static int launch(job_t proto, int threads, float *dqb, int64_t nq) {
    threads = job_count(threads, proto.ntiles * proto.nkv);
    job_t jobs[MAX_JOBS];
    for (int t = 0; t < threads; t++) {
        jobs[t] = proto;
        jobs[t].job = t;
        jobs[t].jobs = threads;
        jobs[t].dqb = dqb ? dqb + (int64_t)t * nq : NULL;
        jobs[t].status = -1;
    }
    run_jobs(jobs, sizeof(job_t), threads, run_thread);
    int rc = 0;
    for (int t = 0; t < threads; t++)
        if (jobs[t].status != 0) rc = -1;
    return rc;
}

int grpokit_packed_forward(const float *q, const float *v, const float *kt, const int64_t *a0,
                           const int64_t *a1, const int64_t *b0, const int64_t *qtiles, int64_t nqt,
                           int64_t N, int nkv, int r, int d, float scale, float *out, float *lse,
                           int threads) {
    job_t J;
    memset(&J, 0, sizeof J);
    J.q = q; J.v = v; J.kt = kt; J.a0 = a0; J.a1 = a1; J.b0 = b0; J.tiles = qtiles; J.ntiles = nqt;
    J.N = N; J.nkv = nkv; J.r = r; J.d = d; J.scale = scale; J.out = out; J.out_lse = lse;
    J.which = 0;
    return launch(J, threads, NULL, 0);
}

/* one pass over key tiles: dk and dv per tile, dq into each job's own buffer, summed in job order */
int grpokit_packed_backward(const float *q, const float *k, const float *kt, const float *vt,
                            const float *dO, const float *lse, const float *D, const int64_t *e,
                            const int64_t *u, const int64_t *rs, const int64_t *rows,
                            const int64_t *ktiles, int64_t nkt, int64_t N, int nkv, int r, int d,
                            float scale, float *dq, float *dk, float *dv, int threads) {
    job_t J;
    memset(&J, 0, sizeof J);
    J.q = q; J.k = k; J.kt = kt; J.vt = vt; J.dO = dO; J.lse = lse; J.D = D; J.e = e; J.u = u;
    J.rs = rs; J.rows = rows; J.tiles = ktiles; J.ntiles = nkt; J.N = N; J.nkv = nkv; J.r = r;
    J.d = d; J.scale = scale; J.which = 1; J.g1 = dk; J.g2 = dv;
    threads = job_count(threads, nkt * nkv);
    const int64_t nq = N * (int64_t)nkv * r * d;
    float *bufs = (float *)calloc((size_t)threads * (size_t)nq, sizeof(float));
    if (!bufs) return -1;
    const int rc = launch(J, threads, bufs, nq);
    for (int64_t i = 0; i < nq; i++) {
        float a = bufs[i];
        for (int t = 1; t < threads; t++) a += bufs[(int64_t)t * nq + i];
        dq[i] = a;
    }
    free(bufs);
    return rc;
}
#endif
