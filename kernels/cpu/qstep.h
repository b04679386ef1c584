// The rest of a CPU decode step beside its products: RMSNorm, RoPE, SiLU x up and attention of
// one query row over float32 K/V. Included by qkernels.cpp inside its anonymous namespace (one
// copy per instruction set); qops.cpp loops over rows and heads and runs the tasks on torch's
// threads.
//
// Attention is split over chunks of keys (flash-decoding): each chunk gives, per query head,
// its largest score, the sum of exp(score - largest) and the unnormalised sum of V rows
// weighted by those; qops.cpp merges the chunks exactly. Within a chunk the AVX2 path goes a
// block of 128 keys at a time with a running maximum, so K and V rows are each read once for
// all the query heads of their KV head, and exponentiates 8 scores at a time (a Cephes-style
// polynomial: within 2 ulp of expf). Bound by memory: ~20 GB/s of float32 K/V on the 2-core
// development VM, where a plain sum streams ~21.

// one element of a float32 or float16 row (K/V rows: f32 or --kv-dtype f16)
inline float half_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return fp16_to_fp32(h);
#endif
}

inline float ld1(const float* p) { return *p; }
inline float ld1(const uint16_t* p) { return half_to_f32(*p); }

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

#endif

#if defined(__AVX512F__)
// exp8 16 lanes at a time: the same polynomial (the AVX-512 builds' attention kernels)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
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

#if defined(__AVX2__)
// 8 elements of a float32 or float16 row as float32
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows this far ahead are asked of memory while the current one is used (the hardware's
// prefetcher alone left the loads waiting: ~5.5 GB/s of f16 rows a thread, where a sum streams 12)
constexpr int64_t KV_AHEAD = 96;
template <typename T>
inline void prefetch_row(const T* p, int64_t d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < d * (int64_t)sizeof(T); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// scores (HG, t) = q (HG, d) . k_j * scale for t keys, each key row read once, in order. Four
// keys at a time, one accumulator per (head, key): their four sums come out of one transposing
// reduction (3 hadds), not a horizontal sum per key and head. kf, where given: key j's factor
// too (the score q . k_j * (kf[j] * scale): MiniCache's per-key factors, contiguous)
template <int HG, typename T = float>
inline void scores_rows(const float* q, const T* k, int64_t ks, int64_t t, int64_t d,
                        float scale, float* sc, int64_t ss, const float* kf = nullptr) {
  const __m128 sv = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= t; j += 4) {
    __m256 acc[HG][4];
    for (int a = 0; a < HG; a++)
      for (int c = 0; c < 4; c++) acc[a][c] = _mm256_setzero_ps();
    const T* kr = k + j * ks;
    for (int c = 0; c < 4; c++) prefetch_row(kr + (KV_AHEAD + c) * ks, d);
    for (int64_t i = 0; i < d; i += 8)
      for (int c = 0; c < 4; c++) {
        const __m256 kc = ld8(kr + c * ks + i);
        for (int a = 0; a < HG; a++)
          acc[a][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + a * d + i), kc, acc[a][c]);
      }
    for (int a = 0; a < HG; a++) {
      const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(acc[a][0], acc[a][1]),
                                      _mm256_hadd_ps(acc[a][2], acc[a][3]));
      const __m128 four = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      _mm_storeu_ps(sc + a * ss + j,
                    _mm_mul_ps(four, kf ? _mm_mul_ps(_mm_loadu_ps(kf + j), sv) : sv));
    }
  }
  for (; j < t; j++) {
    __m256 acc[HG];
    for (int a = 0; a < HG; a++) acc[a] = _mm256_setzero_ps();
    const T* kr = k + j * ks;
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 kc = ld8(kr + i);
      for (int a = 0; a < HG; a++)
        acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(q + a * d + i), kc, acc[a]);
    }
    for (int a = 0; a < HG; a++) sc[a * ss + j] = hsum(acc[a]) * (kf ? kf[j] * scale : scale);
  }
}

// out (HG, d) = out * r[a] + sum_j p[a][j] v_j: CW vectors of columns a pass, one accumulator
// each per head, so accumulators and value vectors stay in registers (AVX2 has 16: 32 columns
// for 2-3 heads; with AVX-512's 32, 64 columns); a pass after the first reads the block's rows
// from L1
#if defined(__AVX512F__)
template <int HG> constexpr int kWeighVecs = 8;
#else
template <int HG> constexpr int kWeighVecs = HG == 1 ? 8 : 4;
#endif
template <int HG, typename T = float>
inline void weigh_rows(const float* p, int64_t ps, int64_t t, const T* v, int64_t vs,
                       int64_t d, const float* r, float* out) {
  constexpr int CW = kWeighVecs<HG>;
  for (int64_t c0 = 0; c0 < d; c0 += 8 * CW) {
    __m256 acc[HG][CW];
    for (int a = 0; a < HG; a++) {
      const __m256 ra = _mm256_set1_ps(r[a]);
      for (int c = 0; c < CW; c++)
        acc[a][c] = _mm256_mul_ps(_mm256_loadu_ps(out + a * d + c0 + 8 * c), ra);
    }
    for (int64_t j = 0; j < t; j++) {
      if (c0 == 0) prefetch_row(v + (j + KV_AHEAD) * vs, d);
      __m256 vv[CW];
      for (int c = 0; c < CW; c++) vv[c] = ld8(v + j * vs + c0 + 8 * c);
      for (int a = 0; a < HG; a++) {
        const __m256 pa = _mm256_set1_ps(p[a * ps + j]);
        for (int c = 0; c < CW; c++) acc[a][c] = _mm256_fmadd_ps(pa, vv[c], acc[a][c]);
      }
    }
    for (int a = 0; a < HG; a++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(out + a * d + c0 + 8 * c, acc[a][c]);
  }
}

// HG heads over t keys, a block of keys at a time with a running maximum (online softmax): K
// and V blocks alternate, so both stream from memory once, at the machine's streaming rate
// A block's scores sc (HG rows, stride ss, n keys) -> exp(score - running max) in place, -inf
// scores 0; the running max and sum per row, r: the factor on the row's earlier sums. vf, where
// given: each weight stored times vf[j] (summed without it: MiniCache's value factors)
template <int HG>
inline void softmax_block(float* sc, int64_t ss, int64_t n, float* mx, float* sm, float* r,
                          const float* vf = nullptr) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int a = 0; a < HG; a++) {
    float* s = sc + a * ss;
    float m = mx[a];
    int64_t j = 0;
    if (n >= 8) {
      __m256 mv = _mm256_set1_ps(m);
      for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(s + j), mv);  // a NaN score is passed over, as below
      m = hmax(mv);
    }
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    if (m == -INFINITY) {  // nothing visible yet
      r[a] = 1.f;
      for (j = 0; j < n; j++) s[j] = 0.f;
      continue;
    }
    r[a] = std::exp(mx[a] - m);  // 0 on the first block (exp(-inf))
    __m256 tv = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 x = _mm256_loadu_ps(s + j);
      __m256 e = exp8(_mm256_sub_ps(x, _mm256_set1_ps(m)));
      e = _mm256_and_ps(e, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));  // exp8 clamps: -inf -> 0
      _mm256_storeu_ps(s + j, vf ? _mm256_mul_ps(e, _mm256_loadu_ps(vf + j)) : e);
      tv = _mm256_add_ps(tv, e);
    }
    float total = hsum(tv);
    for (; j < n; j++) {
      const float e = std::exp(s[j] - m);
      s[j] = vf ? e * vf[j] : e;
      total += e;
    }
    sm[a] = sm[a] * r[a] + total;
    mx[a] = m;
  }
}


// attn_heads' blocks of ATTN_KB keys from j0 to t (j0 a block's start), its running (out, mx,
// sm) carried on; kf, vf, where given: key j's factor on its score and value j's on its weight
// (MiniCache's merged tokens: scores_rows' and softmax_block's, indexed by j as k and v are)
constexpr int64_t ATTN_KB = 128;
template <int HG, typename T = float>
inline void attn_blocks(const float* q, const T* k, int64_t ks, const T* v, int64_t vs,
                        int64_t j0, int64_t t, int64_t d, float scale, float* out, float* mx,
                        float* sm, float* sout = nullptr, int64_t ldo = 0,
                        const float* kf = nullptr, const float* vf = nullptr) {
  constexpr int64_t KB = ATTN_KB;
  float sc[HG * KB], r[HG];
  for (; j0 < t; j0 += KB) {
    const int64_t n = t - j0 < KB ? t - j0 : KB;
    scores_rows<HG, T>(q, k + j0 * ks, ks, n, d, scale, sc, KB, kf ? kf + j0 : nullptr);
    if (sout != nullptr)
      for (int a = 0; a < HG; a++)
        std::memcpy(sout + a * ldo + j0, sc + a * KB, n * sizeof(float));  // the raw scores
    softmax_block<HG>(sc, KB, n, mx, sm, r, vf ? vf + j0 : nullptr);
    weigh_rows<HG, T>(sc, KB, n, v + j0 * vs, vs, d, r, out);
  }
}

// sout, where given: each raw score also stored at sout[a * ldo + j] (tova_attn.h's scores)
template <int HG, typename T = float>
void attn_heads(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t t,
                int64_t d, float scale, float* out, float* mx, float* sm, float* sout = nullptr,
                int64_t ldo = 0) {
  for (int a = 0; a < HG; a++) {
    mx[a] = -INFINITY;
    sm[a] = 0.f;
  }
  for (int64_t i = 0; i < HG * d; i++) out[i] = 0.f;
  attn_blocks<HG, T>(q, k, ks, v, vs, 0, t, d, scale, out, mx, sm, sout, ldo);
}
#endif

// One chunk of t keys for g query heads sharing a KV head: q (g, d) contiguous; key j at
// k + j * ks, value j at v + j * vs; out (g, d): the sum of value rows weighted by
// exp(score - mx); mx, sm (g): the largest score and the sum of those weights. scores:
// scratch of g * t floats (the portable path's). Vector path: heads in groups of up to 3 (as
// even as may be), each group reading K and V once.
// K/V rows of T: float32, or float16 (--kv-dtype f16, converted in the loads: attn_chunk_f16).
// sout (g rows of stride ldo), where given, gets every raw score (attn_chunk_scores).
template <typename T>
void attn_chunk_of(const float* q, int g, const T* k, int64_t ks, const T* v, int64_t vs,
                   int64_t t, int64_t d, float scale, float* out, float* mx, float* sm,
                   float* scores, float* sout = nullptr, int64_t ldo = 0) {
#if defined(__AVX2__)
  if (d % 64 == 0) {
    const int groups = (g + 2) / 3;
    for (int gi = 0, h0 = 0; gi < groups; gi++) {
      const int hn = (g - h0) / (groups - gi) + ((g - h0) % (groups - gi) ? 1 : 0);
      const float* qh = q + h0 * d;
      float* oh = out + h0 * d;
      float* so = sout != nullptr ? sout + h0 * ldo : nullptr;
      if (hn == 3) attn_heads<3, T>(qh, k, ks, v, vs, t, d, scale, oh, mx + h0, sm + h0, so, ldo);
      else if (hn == 2) attn_heads<2, T>(qh, k, ks, v, vs, t, d, scale, oh, mx + h0, sm + h0, so, ldo);
      else attn_heads<1, T>(qh, k, ks, v, vs, t, d, scale, oh, mx + h0, sm + h0, so, ldo);
      h0 += hn;
    }
    return;
  }
#endif
  for (int h = 0; h < g; h++)
    for (int64_t j = 0; j < t; j++) {
      float s = 0.f;
      for (int64_t i = 0; i < d; i++) s += q[h * d + i] * ld1(k + j * ks + i);
      scores[h * t + j] = s * scale;
      if (sout != nullptr) sout[h * ldo + j] = s * scale;
    }
  for (int h = 0; h < g; h++) {
    float* sc = scores + h * t;
    float m = -INFINITY;
    for (int64_t j = 0; j < t; j++) m = sc[j] > m ? sc[j] : m;
    float total = 0.f;
    for (int64_t j = 0; j < t; j++) {
      sc[j] = std::exp(sc[j] - m);
      total += sc[j];
    }
    mx[h] = m;
    sm[h] = total;
  }
  for (int64_t i = 0; i < g * d; i++) out[i] = 0.f;
  for (int h = 0; h < g; h++)
    for (int64_t j = 0; j < t; j++) {
      const float p = scores[h * t + j];
      for (int64_t i = 0; i < d; i++) out[h * d + i] += p * ld1(v + j * vs + i);
    }
}

void attn_chunk(const float* q, int g, const float* k, int64_t ks, const float* v, int64_t vs,
                int64_t t, int64_t d, float scale, float* out, float* mx, float* sm,
                float* scores) {
  attn_chunk_of<float>(q, g, k, ks, v, vs, t, d, scale, out, mx, sm, scores);
}

void attn_chunk_f16(const float* q, int g, const uint16_t* k, int64_t ks, const uint16_t* v,
                    int64_t vs, int64_t t, int64_t d, float scale, float* out, float* mx,
                    float* sm, float* scores) {
  attn_chunk_of<uint16_t>(q, g, k, ks, v, vs, t, d, scale, out, mx, sm, scores);
}
