// The rest of a CPU decode step beside its products: RMSNorm, RoPE, SiLU x up and attention of
// one query row over float32 K/V. Included by qkernels.cpp inside its anonymous namespace (one
// copy per instruction set); qops.cpp loops over rows and heads and runs the tasks on torch's
// threads.
//
// Attention is split over chunks of keys (flash-decoding): each chunk gives, per query head,
// its largest score, the sum of exp(score - largest) and the unnormalised sum of V rows
// weighted by those; qops.cpp merges the chunks exactly. The AVX2 path computes 8 keys' scores
// at once and exponentiates 8 at a time (a Cephes-style polynomial: within 2 ulp of expf).

#if defined(__AVX2__)
// exp(x) for x <= 0 (scores minus their maximum) and moderately positive x
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// the 8 sums of a[0..7] in one vector
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

// y = (x * w) * (1 / sqrt(mean(x^2) + eps))
void rmsnorm_row(const float* x, const float* w, float eps, float* y, int64_t d) {
  float ss = 0.f;
  int64_t i = 0;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= d; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < d; i++) ss += x[i] * x[i];
  const float s = 1.f / std::sqrt(ss / (float)d + eps);
  for (i = 0; i < d; i++) y[i] = (x[i] * w[i]) * s;
}

// y = x * cos + roll(x, d / 2) * ssin (ssin: sin with rotate_half's sign folded in)
void rope_row(const float* x, const float* cos, const float* ssin, float* y, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < d; i++) y[i] = x[i] * cos[i] + x[i < h ? i + h : i - h] * ssin[i];
}

// y = silu(g) * u = g / (1 + exp(-g)) * u
void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; i++) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// One chunk of t keys for g query heads sharing a KV head: q (g, d) contiguous; key j at
// k + j * ks, value j at v + j * vs; out (g, d) += nothing: written as the weighted sum;
// mx, sm (g): largest score and sum of exp(score - mx). scores: scratch of g * t floats.
void attn_chunk(const float* q, int g, const float* k, int64_t ks, const float* v, int64_t vs,
                int64_t t, int64_t d, float scale, float* out, float* mx, float* sm,
                float* scores) {
  for (int h = 0; h < g; h++) {
    const float* qh = q + h * d;
    float* sc = scores + h * t;
    int64_t j = 0;
#if defined(__AVX2__)
    if (d % 8 == 0) {
      for (; j + 8 <= t; j += 8) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + i);
          for (int r = 0; r < 8; r++)
            acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j + r) * ks + i), acc[r]);
        }
        _mm256_storeu_ps(sc + j, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
      }
    }
#endif
    for (; j < t; j++) {
      float s = 0.f;
      for (int64_t i = 0; i < d; i++) s += qh[i] * k[j * ks + i];
      sc[j] = s * scale;
    }
    float m = -INFINITY;
    for (j = 0; j < t; j++) m = std::fmax(m, sc[j]);
    float total = 0.f;
    j = 0;
#if defined(__AVX2__)
    __m256 tv = _mm256_setzero_ps();
    for (; j + 8 <= t; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), _mm256_set1_ps(m)));
      _mm256_storeu_ps(sc + j, e);
      tv = _mm256_add_ps(tv, e);
    }
    total = hsum(tv);
#endif
    for (; j < t; j++) {
      sc[j] = std::exp(sc[j] - m);
      total += sc[j];
    }
    mx[h] = m;
    sm[h] = total;
    float* o = out + h * d;
    for (int64_t i = 0; i < d; i++) o[i] = 0.f;
    j = 0;
#if defined(__AVX2__)
    if (d % 64 == 0) {  // 64 output floats (8 vectors) a pass over the chunk's values
      for (int64_t c0 = 0; c0 < d; c0 += 64) {
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t jj = 0; jj < t; jj++) {
          const __m256 p = _mm256_set1_ps(sc[jj]);
          const float* vr = v + jj * vs + c0;
          for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(o + c0 + 8 * c, acc[c]);
      }
      j = t;
    }
#endif
    for (; j < t; j++) {
      const float p = sc[j];
      const float* vr = v + j * vs;
      for (int64_t i = 0; i < d; i++) o[i] += p * vr[i];
    }
  }
}
