/* What grpokit's C kernels share: 8-wide float vectors where the compiler targets AVX2 with FMA
 * (VEC = 1; the kernels keep a scalar path for every other machine), their horizontal sum and
 * maximum, and e^x for x <= 0. Included by every kernel in this folder (grpokit/cbuild.py builds each
 * with this directory on the include path, and names a build by these headers too). */
#ifndef GRPOKIT_SIMD_H
#define GRPOKIT_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 1
#else
#define VEC 0
#endif

#if VEC
static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0, and for x a little above it (Cephes' single-precision polynomial after range
   reduction, within 2 ulp; sample.c passes up to 0.04); x below -87.3 gives
   about 1e-38, not 0 (callers that need an exact 0 there mask those lanes) */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 g = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    g = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), g);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, g, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(g, g), _mm256_add_ps(g, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(n));
}
#endif

#endif
