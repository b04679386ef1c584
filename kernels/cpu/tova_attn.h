// Attention over float32 K/V that keeps the probabilities it computes, for the methods that
// score keys by them: TOVA's step (the newest query's softmax), H2O's and MiniKV's column sums,
// KVzip's reconstruction maxima. Included by qkernels.cpp after qstep.h (whose exp8, hsum,
// scores_rows and weigh_rows it uses), one copy per instruction set; qops.cpp drives it.
//
// Decode (attn_chunk_scores): qstep.h's chunk of keys, also writing every raw score; once the
// driver's merge gives each row's log-sum-exp, probs_row turns them into probabilities
// (no second pass over the cache).
//
// Prefill (attn_rows_probs): a block of query rows of one KV head holds all its scores (R x n
// floats), so each row's softmax is exact in one go: max, exp, sum, then out = P V and the
// probabilities folded into column sums (or maxima). Keys go in blocks of KB so a block of K
// (or V) stays in L2 while every row of the block reads it.

#if defined(__AVX2__)
// 4 partial-sum vectors -> their 4 sums
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// S rows (RR of them, q (RR, d)) over keys [j0, j1): s[r][j] = q_r . k_j * scale, 4 keys a step
template <int RR>
inline void qk_tile(const float* q, int64_t d, const float* k, int64_t ks, int64_t j0,
                    int64_t j1, float scale, float* s, int64_t ls) {
  const __m128 sc = _mm_set1_ps(scale);
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    __m256 acc[RR][4];
    for (int r = 0; r < RR; r++)
      for (int x = 0; x < 4; x++) acc[r][x] = _mm256_setzero_ps();
    const float* kj = k + j * ks;
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 k0 = _mm256_loadu_ps(kj + c), k1 = _mm256_loadu_ps(kj + ks + c);
      const __m256 k2 = _mm256_loadu_ps(kj + 2 * ks + c), k3 = _mm256_loadu_ps(kj + 3 * ks + c);
      for (int r = 0; r < RR; r++) {
        const __m256 qv = _mm256_loadu_ps(q + r * d + c);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(qv, k2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < RR; r++)
      _mm_storeu_ps(s + r * ls + j, _mm_mul_ps(hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
  }
  for (; j < j1; j++)
    for (int r = 0; r < RR; r++) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * d + c), _mm256_loadu_ps(k + j * ks + c), a);
      s[r * ls + j] = hsum(a) * scale;
    }
}

// out rows (RR of them, 16 columns from c0) += sum_j p[r][j] v_j over keys [j0, j1)
template <int RR>
inline void pv_tile(const float* p, int64_t lp, const float* v, int64_t vs, int64_t j0, int64_t j1,
                    int64_t c0, float* out, int64_t d) {
  __m256 acc[RR][2];
  for (int r = 0; r < RR; r++) {
    acc[r][0] = _mm256_loadu_ps(out + r * d + c0);
    acc[r][1] = _mm256_loadu_ps(out + r * d + c0 + 8);
  }
  for (int64_t j = j0; j < j1; j++) {
    const __m256 v0 = _mm256_loadu_ps(v + j * vs + c0), v1 = _mm256_loadu_ps(v + j * vs + c0 + 8);
    for (int r = 0; r < RR; r++) {
      const __m256 pr = _mm256_broadcast_ss(p + r * lp + j);
      acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < RR; r++) {
    _mm256_storeu_ps(out + r * d + c0, acc[r][0]);
    _mm256_storeu_ps(out + r * d + c0 + 8, acc[r][1]);
  }
}
#endif

#if defined(__AVX512F__)
// K packed for the broadcast product: groups of 16 keys, kt[(b * d + c) * 16 + x] = key b * 16 + x,
// column c; zero past n up to a multiple of 64 keys (a whole block)
void pack_kt(const float* k, int64_t ks, int64_t n, int64_t d, float* kt) {
  const int64_t groups = (n + 63) / 64 * 4;
  for (int64_t b = 0; b < groups; b++)
    for (int64_t x = 0; x < 16; x++) {
      const int64_t j = b * 16 + x;
      for (int64_t c = 0; c < d; c++) kt[(b * d + c) * 16 + x] = j < n ? k[j * ks + c] : 0.f;
    }
}

// s rows (RR, from q (RR, d)) for 16 * KV packed keys: each column of K broadcast against a row's
// query value, no horizontal sums
template <int RR, int KV>
inline void qk512(const float* q, int64_t d, const float* kt, float scale, float* s, int64_t ls) {
  __m512 acc[RR][KV];
  for (int r = 0; r < RR; r++)
    for (int x = 0; x < KV; x++) acc[r][x] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c++) {
    __m512 kk[KV];
    for (int x = 0; x < KV; x++) kk[x] = _mm512_loadu_ps(kt + (x * d + c) * 16);
    for (int r = 0; r < RR; r++) {
      const __m512 qb = _mm512_set1_ps(q[r * d + c]);
      for (int x = 0; x < KV; x++) acc[r][x] = _mm512_fmadd_ps(qb, kk[x], acc[r][x]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < RR; r++)
    for (int x = 0; x < KV; x++) _mm512_storeu_ps(s + r * ls + 16 * x, _mm512_mul_ps(acc[r][x], sc));
}

template <int RR>
inline void qk512_rows(const float* q, int64_t d, const float* kt, int64_t m, float scale,
                       float* s, int64_t ls) {
  int64_t j = 0;
  for (; j + 32 <= m; j += 32) qk512<RR, 2>(q, d, kt + j * d, scale, s + j, ls);
  for (; j < m; j += 16) qk512<RR, 1>(q, d, kt + j * d, scale, s + j, ls);  // ls has room
}

// out rows (RR, 64 columns from c0) += sum_j p[r][j] v_j
template <int RR>
inline void pv512(const float* p, int64_t lp, const float* v, int64_t vs, int64_t m, int64_t c0,
                  float* out, int64_t d) {
  __m512 acc[RR][4];
  for (int r = 0; r < RR; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_loadu_ps(out + r * d + c0 + 16 * c);
  for (int64_t j = 0; j < m; j++) {
    __m512 vv[4];
    for (int c = 0; c < 4; c++) vv[c] = _mm512_loadu_ps(v + j * vs + c0 + 16 * c);
    for (int r = 0; r < RR; r++) {
      const __m512 pr = _mm512_set1_ps(p[r * lp + j]);
      for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RR; r++)
    for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + r * d + c0 + 16 * c, acc[r][c]);
}
#endif

// s rows (R, stride ls) = q_r . k_j * scale over a block's m keys (key j at k + j * ks), or from
// kt (the block's keys packed, pack_kt; s rows then have room to a multiple of 16)
inline void qk_block(const float* q, int R, int64_t d, const float* k, int64_t ks,
                     const float* kt, int64_t m, float scale, float* s, int64_t ls) {
  int r = 0;
#if defined(__AVX512F__)
  if (kt != nullptr) {
    for (; r + 12 <= R; r += 12) qk512_rows<12>(q + r * d, d, kt, m, scale, s + r * ls, ls);
    for (; r + 4 <= R; r += 4) qk512_rows<4>(q + r * d, d, kt, m, scale, s + r * ls, ls);
    for (; r < R; r++) qk512_rows<1>(q + r * d, d, kt, m, scale, s + r * ls, ls);
    return;
  }
#endif
#if defined(__AVX2__)
  if (d % 16 == 0) {
    for (; r + 3 <= R; r += 3) qk_tile<3>(q + r * d, d, k, ks, 0, m, scale, s + r * ls, ls);
    if (R - r == 2) qk_tile<2>(q + r * d, d, k, ks, 0, m, scale, s + r * ls, ls);
    if (R - r == 1) qk_tile<1>(q + r * d, d, k, ks, 0, m, scale, s + r * ls, ls);
    return;
  }
#endif
  for (; r < R; r++)
    for (int64_t j = 0; j < m; j++) {
      float a = 0.f;
      for (int64_t c = 0; c < d; c++) a += q[r * d + c] * k[j * ks + c];
      s[r * ls + j] = a * scale;
    }
}

// out rows (R, d) += sum_j p[r][j] v_j over a block's m keys (value j at v + j * vs)
inline void pv_block(const float* p, int R, int64_t lp, const float* v, int64_t vs, int64_t m,
                     int64_t d, float* out) {
#if defined(__AVX512F__)
  if (d % 64 == 0) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      int r = 0;
      for (; r + 6 <= R; r += 6) pv512<6>(p + r * lp, lp, v, vs, m, c0, out + r * d, d);
      for (; r + 2 <= R; r += 2) pv512<2>(p + r * lp, lp, v, vs, m, c0, out + r * d, d);
      for (; r < R; r++) pv512<1>(p + r * lp, lp, v, vs, m, c0, out + r * d, d);
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if (d % 16 == 0) {
    for (int r = 0; r < R; r += 6) {
      const int rr = R - r < 6 ? R - r : 6;
      for (int64_t c0 = 0; c0 < d; c0 += 16) {
        const float* pr = p + r * lp;
        float* o = out + r * d;
        switch (rr) {
          case 6: pv_tile<6>(pr, lp, v, vs, 0, m, c0, o, d); break;
          case 5: pv_tile<5>(pr, lp, v, vs, 0, m, c0, o, d); break;
          case 4: pv_tile<4>(pr, lp, v, vs, 0, m, c0, o, d); break;
          case 3: pv_tile<3>(pr, lp, v, vs, 0, m, c0, o, d); break;
          case 2: pv_tile<2>(pr, lp, v, vs, 0, m, c0, o, d); break;
          default: pv_tile<1>(pr, lp, v, vs, 0, m, c0, o, d);
        }
      }
    }
    return;
  }
#endif
  for (int r = 0; r < R; r++)
    for (int64_t j = 0; j < m; j++)
      for (int64_t c = 0; c < d; c++) out[r * d + c] += p[r * lp + j] * v[j * vs + c];
}

// Decode: attn_chunk (qstep.h) for g query heads over t keys, also writing each raw score
// (q . k * scale) at sout[a * ldo + j]. scores: scratch of g * t floats (portable path).
void attn_chunk_scores(const float* q, int g, const float* k, int64_t ks, const float* v,
                       int64_t vs, int64_t t, int64_t d, float scale, float* out, float* mx,
                       float* sm, float* scores, float* sout, int64_t ldo) {
  attn_chunk_of<float>(q, g, k, ks, v, vs, t, d, scale, out, mx, sm, scores, sout, ldo);
}

// the same over float16 K/V rows (--kv-dtype f16), converted in the loads
void attn_chunk_scores_f16(const float* q, int g, const uint16_t* k, int64_t ks,
                           const uint16_t* v, int64_t vs, int64_t t, int64_t d, float scale,
                           float* out, float* mx, float* sm, float* scores, float* sout,
                           int64_t ldo) {
  attn_chunk_of<uint16_t>(q, g, k, ks, v, vs, t, d, scale, out, mx, sm, scores, sout, ldo);
}

// s[j] = exp(s[j] - lse) for j < n: a row's raw scores -> its probabilities (0 where lse = -inf)
void probs_row(float* s, int64_t n, float lse) {
  if (lse == -INFINITY) {
    for (int64_t j = 0; j < n; j++) s[j] = 0.f;
    return;
  }
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 l = _mm256_set1_ps(lse);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), l)));
#endif
  for (; j < n; j++) s[j] = std::exp(s[j] - lse);
}

// y[j] += w * x[j] (mode 0) or y[j] = max(y[j], w * x[j]) (mode 1) for j < n
void fold_row(const float* x, int64_t n, float w, int mode, float* y) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 wv = _mm256_set1_ps(w);
  if (mode == 0)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(y + j, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j), _mm256_loadu_ps(y + j)));
  else
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(y + j, _mm256_max_ps(_mm256_loadu_ps(y + j), _mm256_mul_ps(wv, _mm256_loadu_ps(x + j))));
#endif
  if (mode == 0)
    for (; j < n; j++) y[j] += w * x[j];
  else
    for (; j < n; j++) y[j] = y[j] > w * x[j] ? y[j] : w * x[j];
}

// the largest of x[0..n) (-inf for n = 0)
inline float max_row(const float* x, int64_t n) {
  float m = -INFINITY;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 m16 = _mm512_set1_ps(-INFINITY);
  for (; j + 16 <= n; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(x + j));
  m = _mm512_reduce_max_ps(m16);
#endif
#if defined(__AVX2__)
  __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  m = _mm_cvtss_f32(h);
#endif
  for (; j < n; j++) m = x[j] > m ? x[j] : m;
  return m;
}

// x[j] = exp(x[j] - m) for j < n; returns their sum
inline float exp_sum_row(float* x, int64_t n, float m) {
  float total = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 m16 = _mm512_set1_ps(m);
  __m512 t16 = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), m16));
    _mm512_storeu_ps(x + j, e);
    t16 = _mm512_add_ps(t16, e);
  }
  total = _mm512_reduce_add_ps(t16);
#endif
#if defined(__AVX2__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 tv = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    _mm256_storeu_ps(x + j, e);
    tv = _mm256_add_ps(tv, e);
  }
  total += hsum(tv);
#endif
  for (; j < n; j++) {
    x[j] = std::exp(x[j] - m);
    total += x[j];
  }
  return total;
}

// Prefill: R query rows (q (R, d) contiguous) of one KV head over its keys [0, n): key j at
// k + j * ks (kt, where given: the same keys packed by pack_kt), value j at v + j * vs (v null:
// no out); s rows, where kt is given, with room to a multiple of 16. Row r sees key j where kp is null and
// j < lim[r] (causal by slot), else where kp[j] <= lim[r] (its position) and, with win > 0,
// lim[r] - kp[j] < win. Gives out (R, d) normalised (0 for a row that sees nothing) and lse (R)
// (-inf there); with s (R rows of ls >= n floats), each row's probabilities there (masked keys
// 0). Flash-style: blocks of KB keys with a running maximum, K and V of a block read from L1 by
// every row; a block's weights stay in s beside their maximum, and once each row's log-sum-exp
// is known one multiply per block turns them into probabilities (no second exp).
void attn_rows_probs(const float* q, int R, int64_t d, const float* k, int64_t ks,
                     const float* kt, const float* v, int64_t vs, int64_t n, float scale,
                     const int32_t* kp, const int64_t* lim, int64_t win, float* out, float* lse,
                     float* s, int64_t ls) {
  constexpr int64_t KB = 64;  // keys a block: 16 KB of K (and of V) at d = 64
  const int64_t nb = (n + KB - 1) / KB;
  std::vector<float> sb(s ? 0 : R * KB), bm(s ? R * nb : 0), mx(R, -INFINITY), sm(R, 0.f);
  if (v != nullptr)
    for (int64_t i = 0; i < R * d; i++) out[i] = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const int64_t j0 = b * KB, m = n - j0 < KB ? n - j0 : KB;
    float* blk = s ? s + j0 : sb.data();
    const int64_t lb = s ? ls : KB;
    qk_block(q, R, d, k + j0 * ks, ks, kt ? kt + j0 * d : nullptr, m, scale, blk, lb);
    for (int r = 0; r < R; r++) {
      float* sr = blk + r * lb;
      // keys [seen, m) of the block hidden by slot, or each one by position
      const int64_t seen = kp ? m : (lim[r] - j0 < 0 ? 0 : (lim[r] - j0 < m ? lim[r] - j0 : m));
      auto hidden = [&](int64_t j) {
        if (kp == nullptr) return j >= seen;
        const int64_t dist = lim[r] - (int64_t)kp[j0 + j];
        return dist < 0 || (win > 0 && dist >= win);
      };
      if (kp != nullptr)
        for (int64_t j = 0; j < m; j++)
          if (hidden(j)) sr[j] = -INFINITY;
      const float mb = max_row(sr, seen);
      float alpha = 1.f;
      if (mb == -INFINITY) {  // nothing of the block seen by this row
        std::fill(sr, sr + m, 0.f);
      } else {
        const float mnew = mb > mx[r] ? mb : mx[r];
        alpha = std::exp(mx[r] - mnew);  // 0 for the first block the row sees
        float total = exp_sum_row(sr, seen, mnew);
        for (int64_t j = kp ? 0 : seen; j < m; j++)  // exp8 clamps: a hidden key's weight
          if (hidden(j)) {                           // made exactly 0
            total -= j < seen ? sr[j] : 0.f;
            sr[j] = 0.f;
          }
        sm[r] = sm[r] * alpha + total;
        mx[r] = mnew;
      }
      if (s) bm[r * nb + b] = mx[r];
      if (v != nullptr && alpha != 1.f)
        for (int64_t c = 0; c < d; c++) out[r * d + c] *= alpha;
    }
    if (v != nullptr) pv_block(blk, R, lb, v + j0 * vs, vs, m, d, out);
  }
  for (int r = 0; r < R; r++) {
    const bool none = sm[r] == 0.f;
    lse[r] = none ? -INFINITY : mx[r] + std::log(sm[r]);
    if (v != nullptr) {
      const float inv = none ? 0.f : 1.f / sm[r];
      for (int64_t c = 0; c < d; c++) out[r * d + c] *= inv;
    }
    if (s == nullptr) continue;
    for (int64_t b = 0; b < nb; b++) {  // the block's weights -> probabilities
      const int64_t j0 = b * KB, m = n - j0 < KB ? n - j0 : KB;
      const float f = none || bm[r * nb + b] == -INFINITY ? 0.f : std::exp(bm[r * nb + b] - lse[r]);
      float* sr = s + r * ls + j0;
      for (int64_t j = 0; j < m; j++) sr[j] *= f;
    }
  }
}
