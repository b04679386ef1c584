// Attention over keys a store keeps in its own form, one chunk of keys at a time for qops.cpp's
// split_keys: MiniCache's merged pairs (a shared direction E per token, a factor per layer,
// retained exact rows) and SpindleKV's codebook slots (rows gathered from codebooks, scaled,
// keys rotated at their own positions, four slots to one reduction, a keep mask per query head),
// and the codebook search of SpindleKV's decode tokens (best_rows). Included by qkernels.cpp
// after qstep.h (one copy per instruction set); the structs are merged_types.h's.
//
// As qstep.h's attn_heads: the query rows of a KV head in groups of up to 3, each group reading
// a block of keys once for its scores and once (from cache) to weigh the values, with a running
// maximum. Nothing dense is built: a merged key's factor scales its score and a merged value's
// its weight; a codebook key is rotated in registers. Scores of -inf (a masked slot) weigh 0.

inline float elem_at(const void* p, int elem, int64_t i) {
  return elem == EL_F16 ? half_to_f32(static_cast<const uint16_t*>(p)[i])
                        : static_cast<const float*>(p)[i];
}

#if defined(__AVX2__)
// the horizontal sums of up to 4 accumulators at once: out[i] = sum of x[i]'s lanes
template <int N>
inline void hsum4(const __m256* x, float* out) {
  static_assert(N >= 1 && N <= 4, "up to 4 sums");
  const __m256 z = _mm256_setzero_ps();
  const __m256 t0 = _mm256_hadd_ps(x[0], N > 1 ? x[1] : z);
  const __m256 t1 = N > 2 ? _mm256_hadd_ps(x[2], N > 3 ? x[3] : z) : z;
  const __m256 t2 = _mm256_hadd_ps(t0, t1);
  const __m128 r = _mm_add_ps(_mm256_castps256_ps128(t2), _mm256_extractf128_ps(t2, 1));
  alignas(16) float tmp[4];
  _mm_store_ps(tmp, r);
  for (int i = 0; i < N; i++) out[i] = tmp[i];
}

#if defined(__AVX512F__)
inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ld16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// the two halves of x added: 8 lanes
inline __m256 fold8(__m512 x) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(x), hi);
}
#endif
#endif  // __AVX2__

// A head's retained tokens from token j0 on, walked in order alongside the keys.
struct Retained {
  const int32_t* idx = nullptr;
  int64_t r = 0, end = 0;

  Retained(const MergedHalf& m, int64_t h, int64_t j0) {
    if (m.ridx == nullptr) return;
    const int64_t gr = h * m.r_grp;
    idx = m.ridx;
    end = m.roff[gr + 1];
    int64_t lo = m.roff[gr], hi = end;  // first retained index >= j0
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (idx[mid] < j0) lo = mid + 1;
      else hi = mid;
    }
    r = lo;
  }
  bool at(int64_t t) const { return r < end && idx[r] == t; }
};

// Token t of head h: its row and its factor before any norm (`norm`: divide by the row's).
template <typename T>
inline const T* merged_row(const MergedHalf& m, Retained& ret, int64_t h, int64_t t, int unit,
                           float& f, bool& norm) {
  if (ret.at(t)) {
    f = 1.f;
    norm = false;
    return static_cast<const T*>(m.rows) + ret.r++ * m.r_row + h * m.r_col;
  }
  f = m.scale[h * m.s_h + t * m.s_t];
  norm = unit != 0;
  return static_cast<const T*>(m.e) + h * m.e_h + t * m.e_t;
}

inline int64_t book_index(const BookSide& b, int64_t h, int64_t s) {
  const int64_t o = h * b.i_h + s * b.i_s;
  const int64_t i = b.idx_bytes == 2   ? static_cast<const int16_t*>(b.idx)[o]
                    : b.idx_bytes == 4 ? static_cast<const int32_t*>(b.idx)[o]
                                       : static_cast<const int64_t*>(b.idx)[o];
  return i + (b.off != nullptr ? b.off[h] : 0);
}

template <typename T>
inline const T* book_row(const BookSide& b, int64_t h, int64_t s) {
  const T* base = static_cast<const T*>(b.book);
  return b.idx == nullptr ? base + h * b.b_h + s * b.b_r : base + book_index(b, h, s) * b.b_r;
}

inline float book_mag(const BookSide& b, int64_t h, int64_t s) {
  return b.mag == nullptr ? 1.f : elem_at(b.mag, b.mag_elem, h * b.m_h + s * b.m_s);
}

// whether query row r (query head r / tq of the group) sees slot s of head h
inline bool slot_visible(const CodebookArgs& a, int64_t h, int64_t s, int64_t r) {
  if (a.mask == nullptr) return true;
  const int64_t j = r / a.tq;
  return (a.mask[h * a.k_h + s * a.k_s + j / 8] >> (j % 8)) & 1;
}

// ------------------------------------------------------------------------------- portable
// One chunk, row by row: scores (R, n) in `scratch`, then softmax and the weighted values.
// key(r, j, s, vis) gives row r's score of key j (vis false: hidden); value(j, w, o) adds w
// times value j to o.
template <class Key, class Value>
void chunk_rows(int64_t R, int64_t n, int64_t d, const Key& key, const Value& value, float* out,
                float* mx, float* sm, float* scores) {
  for (int64_t r = 0; r < R; r++)
    for (int64_t j = 0; j < n; j++) scores[r * n + j] = key(r, j);
  for (int64_t i = 0; i < R * d; i++) out[i] = 0.f;
  for (int64_t r = 0; r < R; r++) {
    float* sc = scores + r * n;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
    float total = 0.f;
    for (int64_t j = 0; j < n; j++) {
      sc[j] = m == -INFINITY ? 0.f : std::exp(sc[j] - m);
      total += sc[j];
    }
    mx[r] = m;
    sm[r] = total;
    for (int64_t j = 0; j < n; j++)
      if (sc[j] != 0.f) value(j, sc[j], out + r * d);
  }
}

template <typename T>
void merged_portable(const MergedArgs& a, int64_t h, int64_t j0, int64_t n, float* out, float* mx,
                     float* sm, float* scores) {
  const int64_t d = a.d;
  const float* q = a.q + h * a.R * d;
  std::vector<const T*> kp(n), vp(n);
  std::vector<float> fk(n), fv(n);
  Retained rk(a.k, h, j0), rv(a.v, h, j0);
  for (int64_t j = 0; j < n; j++) {
    bool nk, nv;
    kp[j] = merged_row<T>(a.k, rk, h, j0 + j, a.unit, fk[j], nk);
    vp[j] = merged_row<T>(a.v, rv, h, j0 + j, a.unit, fv[j], nv);
    float kk = 0.f, vv = 0.f;
    for (int64_t i = 0; i < d; i++) {
      kk += ld1(kp[j] + i) * ld1(kp[j] + i);
      vv += ld1(vp[j] + i) * ld1(vp[j] + i);
    }
    if (nk && kk > 0.f) fk[j] /= std::sqrt(kk);
    if (nv && vv > 0.f) fv[j] /= std::sqrt(vv);
  }
  chunk_rows(
      a.R, n, d,
      [&](int64_t r, int64_t j) {
        float s = 0.f;
        for (int64_t i = 0; i < d; i++) s += q[r * d + i] * ld1(kp[j] + i);
        return s * (fk[j] * a.scale);
      },
      [&](int64_t j, float w, float* o) {
        const float wf = w * fv[j];
        for (int64_t i = 0; i < d; i++) o[i] += wf * ld1(vp[j] + i);
      },
      out, mx, sm, scores);
}

template <typename T>
void codebook_portable(const CodebookArgs& a, int64_t h, int64_t j0, int64_t n, float* out,
                       float* mx, float* sm, float* scores) {
  const int64_t d = a.d, hd = d / 2;
  const float* q = a.q + h * a.R * d;
  std::vector<float> k(n * d);  // the chunk's keys, rotated
  for (int64_t j = 0; j < n; j++) {
    const T* c = book_row<T>(a.k, h, j0 + j);
    const int64_t p = a.pos[h * a.p_h + (j0 + j) * a.p_s];
    const float *cs = a.cos + p * a.cs_r, *sn = a.sin + p * a.cs_r;
    for (int64_t i = 0; i < hd; i++) {
      const float lo = ld1(c + i), hi = ld1(c + hd + i);
      k[j * d + i] = lo * cs[i] - hi * sn[i];
      k[j * d + hd + i] = hi * cs[i] + lo * sn[i];
    }
  }
  chunk_rows(
      a.R, n, d,
      [&](int64_t r, int64_t j) {
        if (!slot_visible(a, h, j0 + j, r)) return -INFINITY;
        float s = 0.f;
        for (int64_t i = 0; i < d; i++) s += q[r * d + i] * k[j * d + i];
        return s * (book_mag(a.k, h, j0 + j) * a.scale);
      },
      [&](int64_t j, float w, float* o) {
        const T* v = book_row<T>(a.v, h, j0 + j);
        const float wf = w * book_mag(a.v, h, j0 + j);
        for (int64_t i = 0; i < d; i++) o[i] += wf * ld1(v + i);
      },
      out, mx, sm, scores);
}

template <typename T>
void best_rows_portable(const float* u, int64_t nu, const T* book, int64_t stride, int64_t n,
                        int64_t d, float* best, int64_t* arg) {
  for (int64_t i = 0; i < n; i++)
    for (int64_t a = 0; a < nu; a++) {
      float s = 0.f;
      for (int64_t c = 0; c < d; c++) s += u[a * d + c] * ld1(book + i * stride + c);
      if (s > best[a]) {
        best[a] = s;
        arg[a] = i;
      }
    }
}

#if defined(__AVX2__)
// ----------------------------------------------------------------------------------- AVX2

constexpr int64_t SKB = 128;  // keys per block
constexpr float kNegInf = -INFINITY;
constexpr int64_t PREFETCH = 16;  // gathered rows asked for this many keys ahead

// out (HG, d) = out * r[a] + sum_j p[a][j] row_j, rows by pointer: 64 columns a pass (with
// AVX2 alone 32 for several rows, so the accumulators stay in its 16 registers)
template <int HG, typename T>
inline void weigh_ptrs(const float* p, int64_t ps, int64_t n, const T* const* vp, int64_t d,
                       const float* r, float* out) {
#if defined(__AVX512F__)
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 acc[HG][4];
    for (int a = 0; a < HG; a++) {
      const __m512 ra = _mm512_set1_ps(r[a]);
      for (int c = 0; c < 4; c++)
        acc[a][c] = _mm512_mul_ps(_mm512_loadu_ps(out + a * d + c0 + 16 * c), ra);
    }
    for (int64_t j = 0; j < n; j++) {
      if (j + 8 < n)  // gathered rows: asked for a few rows ahead, into L1
        for (int64_t c = 0; c < 64 * (int64_t)sizeof(T); c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(vp[j + 8] + c0) + c, _MM_HINT_T0);
      __m512 vv[4];
      for (int c = 0; c < 4; c++) vv[c] = ld16(vp[j] + c0 + 16 * c);
      for (int a = 0; a < HG; a++) {
        const __m512 pa = _mm512_set1_ps(p[a * ps + j]);
        for (int c = 0; c < 4; c++) acc[a][c] = _mm512_fmadd_ps(pa, vv[c], acc[a][c]);
      }
    }
    for (int a = 0; a < HG; a++)
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + a * d + c0 + 16 * c, acc[a][c]);
  }
#else
  constexpr int C = HG > 1 ? 4 : 8;  // 8-float vectors per pass
  for (int64_t c0 = 0; c0 < d; c0 += 8 * C) {
    __m256 acc[HG][C];
    for (int a = 0; a < HG; a++) {
      const __m256 ra = _mm256_set1_ps(r[a]);
      for (int c = 0; c < C; c++)
        acc[a][c] = _mm256_mul_ps(_mm256_loadu_ps(out + a * d + c0 + 8 * c), ra);
    }
    for (int64_t j = 0; j < n; j++) {
      if (j + 8 < n)  // gathered rows: asked for a few rows ahead, into L1
        for (int64_t c = 0; c < 8 * C * (int64_t)sizeof(T); c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(vp[j + 8] + c0) + c, _MM_HINT_T0);
      __m256 vv[C];
      for (int c = 0; c < C; c++) vv[c] = ld8(vp[j] + c0 + 8 * c);
      for (int a = 0; a < HG; a++) {
        const __m256 pa = _mm256_set1_ps(p[a * ps + j]);
        for (int c = 0; c < C; c++) acc[a][c] = _mm256_fmadd_ps(pa, vv[c], acc[a][c]);
      }
    }
    for (int a = 0; a < HG; a++)
      for (int c = 0; c < C; c++) _mm256_storeu_ps(out + a * d + c0 + 8 * c, acc[a][c]);
  }
#endif
}


// dot[i] = q_i . x for HG rows q (stride d) and one row x of d (a multiple of 16); with NORM
// also *xx = x . x. Two accumulators a row: the multiply-adds need not wait on each other.
template <int HG, bool NORM, typename T>
inline void row_dots(const float* q, int64_t d, const T* x, float* dot, float* xx) {
  __m256 a8[HG];
#if defined(__AVX512F__)
  if (d % 32 == 0) {
    __m512 a0[HG], a1[HG], n0 = _mm512_setzero_ps(), n1 = _mm512_setzero_ps();
    for (int i = 0; i < HG; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32) {
      const __m512 x0 = ld16(x + c), x1 = ld16(x + c + 16);
      for (int i = 0; i < HG; i++) {
        a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * d + c), x0, a0[i]);
        a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * d + c + 16), x1, a1[i]);
      }
      if (NORM) {
        n0 = _mm512_fmadd_ps(x0, x0, n0);
        n1 = _mm512_fmadd_ps(x1, x1, n1);
      }
    }
    for (int i = 0; i < HG; i++) a8[i] = fold8(_mm512_add_ps(a0[i], a1[i]));
    if (NORM) *xx = hsum(fold8(_mm512_add_ps(n0, n1)));
    hsum4<HG>(a8, dot);
    return;
  }
#endif
  __m256 a1[HG], n0 = _mm256_setzero_ps(), n1 = _mm256_setzero_ps();
  for (int i = 0; i < HG; i++) a8[i] = a1[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m256 x0 = ld8(x + c), x1 = ld8(x + c + 8);
    for (int i = 0; i < HG; i++) {
      a8[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + c), x0, a8[i]);
      a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + c + 8), x1, a1[i]);
    }
    if (NORM) {
      n0 = _mm256_fmadd_ps(x0, x0, n0);
      n1 = _mm256_fmadd_ps(x1, x1, n1);
    }
  }
  for (int i = 0; i < HG; i++) a8[i] = _mm256_add_ps(a8[i], a1[i]);
  if (NORM) *xx = hsum(_mm256_add_ps(n0, n1));
  hsum4<HG>(a8, dot);
}

// x . x for a row of d (a multiple of 16)
template <typename T>
inline float sumsq(const T* x, int64_t d) {
  __m256 n0 = _mm256_setzero_ps(), n1 = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) {
    const __m256 x0 = ld8(x + c), x1 = ld8(x + c + 8);
    n0 = _mm256_fmadd_ps(x0, x0, n0);
    n1 = _mm256_fmadd_ps(x1, x1, n1);
  }
  return hsum(_mm256_add_ps(n0, n1));
}

// HG query rows of head h over merged keys [j0, j0 + n); UNIT: each E row divided by its norm
// here (else the factors are whole)
template <int HG, typename T, bool UNIT>
void merged_heads(const MergedArgs& a, int64_t h, const float* q, int64_t j0, int64_t n,
                  float* out, float* mx, float* sm) {
  const int64_t d = a.d;
  float sc[HG * SKB], r[HG], fk[SKB], fv[SKB];
  const T* kp[SKB];
  const T* vp[SKB];
  bool nk[SKB], nv[SKB];
  for (int i = 0; i < HG; i++) {
    mx[i] = -INFINITY;
    sm[i] = 0.f;
  }
  for (int64_t i = 0; i < HG * d; i++) out[i] = 0.f;
  Retained rk(a.k, h, j0), rv(a.v, h, j0);
  const T* ek = static_cast<const T*>(a.k.e) + h * a.k.e_h;
  const T* ev = static_cast<const T*>(a.v.e) + h * a.v.e_h;
  for (int64_t b0 = j0; b0 < j0 + n; b0 += SKB) {
    const int64_t nb = std::min<int64_t>(SKB, j0 + n - b0);
    for (int64_t j = 0; j < nb; j++) {
      kp[j] = merged_row<T>(a.k, rk, h, b0 + j, UNIT, fk[j], nk[j]);
      vp[j] = merged_row<T>(a.v, rv, h, b0 + j, UNIT, fv[j], nv[j]);
    }
    for (int64_t j = 0; j < nb; j++) {
      // E's rows ahead asked of memory (as qstep.h's dense rows; retained rows are few)
      prefetch_row(ek + (b0 + j + KV_AHEAD) * a.k.e_t, d);
      prefetch_row(ev + (b0 + j + KV_AHEAD) * a.v.e_t, d);
      float dot[HG], kk = 0.f, f = fk[j];
      row_dots<HG, UNIT, T>(q, d, kp[j], dot, &kk);
      if (UNIT && nk[j] && kk > 0.f) f /= std::sqrt(kk);
      if (UNIT && nv[j]) {  // the value's norm, read now so the weighing finds the row in cache
        const float vv = sumsq(vp[j], d);
        if (vv > 0.f) fv[j] /= std::sqrt(vv);
      }
      const float fs = f * a.scale;
      for (int i = 0; i < HG; i++) sc[i * SKB + j] = dot[i] * fs;
    }
    softmax_block<HG>(sc, SKB, nb, mx, sm, r);
    for (int i = 0; i < HG; i++)
      for (int64_t j = 0; j < nb; j++) sc[i * SKB + j] *= fv[j];
    weigh_ptrs<HG, T>(sc, SKB, nb, vp, d, r, out);
  }
}

// sc[i][j] *= f[j * st] * c for HG rows (stride SKB) of n columns (factors not contiguous, or
// a block with retained values)
template <int HG>
inline void scale_cols(float* sc, int64_t n, const float* f, int64_t st, float c) {
  for (int64_t j = 0; j < n; j++) {
    const float fj = f[j * st] * c;
    for (int i = 0; i < HG; i++) sc[i * SKB + j] *= fj;
  }
}

// merged_heads over an f16 E with whole factors (the CLI's store under --kv-dtype auto): E's
// rows stream as a dense cache's do (qstep.h's scores_rows, four keys to one transposing
// reduction, and weigh_rows), each score scaled by its key's factor and each weight by its
// value's; a retained token's score comes from its exact row instead and its weight goes to
// that row, not to E's. The f32 store keeps merged_heads' per-row sums (its logits stay bit
// for bit those of the exact path).
template <int HG, typename T>
void merged_heads_stream(const MergedArgs& a, int64_t h, const float* q, int64_t j0, int64_t n,
                         float* out, float* mx, float* sm) {
  const int64_t d = a.d;
  float sc[HG * SKB], r[HG], pr[HG * SKB];
  const T* vp[SKB];
  float ones[HG];  // weigh_ptrs' factor on out for the retained rows: none
  for (int i = 0; i < HG; i++) {
    mx[i] = -INFINITY;
    sm[i] = 0.f;
    ones[i] = 1.f;
  }
  for (int64_t i = 0; i < HG * d; i++) out[i] = 0.f;
  Retained rk(a.k, h, j0), rv(a.v, h, j0);
  const T* ek = static_cast<const T*>(a.k.e) + h * a.k.e_h;
  const T* ev = static_cast<const T*>(a.v.e) + h * a.v.e_h;
  const float* fk = a.k.scale + h * a.k.s_h;
  const float* fv = a.v.scale + h * a.v.s_h;
  const bool runs = a.k.s_t == 1 && a.v.s_t == 1 && SKB == ATTN_KB;
  for (int64_t b0 = j0; b0 < j0 + n; b0 += SKB) {
    if (runs) {  // the whole blocks before the next retained token of either half: the dense
      int64_t next = j0 + n;  // cache's own loop (attn_blocks), the factors in its passes
      if (rk.r < rk.end) next = std::min<int64_t>(next, rk.idx[rk.r]);
      if (rv.r < rv.end) next = std::min<int64_t>(next, rv.idx[rv.r]);
      const int64_t end = next == j0 + n ? next : b0 + (next - b0) / SKB * SKB;
      if (end > b0) {
        attn_blocks<HG, T>(q, ek, a.k.e_t, ev, a.v.e_t, b0, end, d, a.scale, out, mx, sm,
                           nullptr, 0, fk, fv);
        b0 = end - SKB;  // the loop's step: the next block
        continue;
      }
    }
    // a block holding a retained token (or factors not contiguous)
    const int64_t nb = std::min<int64_t>(SKB, j0 + n - b0), b1 = b0 + nb;
    if (a.k.s_t == 1) {  // each key's factor applied in the scores' own pass
      scores_rows<HG, T>(q, ek + b0 * a.k.e_t, a.k.e_t, nb, d, a.scale, sc, SKB, fk + b0);
    } else {
      scores_rows<HG, T>(q, ek + b0 * a.k.e_t, a.k.e_t, nb, d, 1.f, sc, SKB);
      scale_cols<HG>(sc, nb, fk + b0 * a.k.s_t, a.k.s_t, a.scale);
    }
    for (; rk.r < rk.end && rk.idx[rk.r] < b1; rk.r++) {  // retained keys: their exact rows
      const T* row = static_cast<const T*>(a.k.rows) + rk.r * a.k.r_row + h * a.k.r_col;
      float dot[HG];
      row_dots<HG, false, T>(q, d, row, dot, nullptr);
      for (int i = 0; i < HG; i++) sc[i * SKB + rk.idx[rk.r] - b0] = dot[i] * a.scale;
    }
    int64_t nr = 0;  // retained values: their weights moved to their exact rows
    if (a.v.s_t == 1 && !(rv.r < rv.end && rv.idx[rv.r] < b1)) {  // none here: the values'
      softmax_block<HG>(sc, SKB, nb, mx, sm, r, fv + b0);     // factors in the softmax's pass
    } else {
      softmax_block<HG>(sc, SKB, nb, mx, sm, r);
      for (; rv.r < rv.end && rv.idx[rv.r] < b1; rv.r++, nr++) {
        const int64_t j = rv.idx[rv.r] - b0;
        vp[nr] = static_cast<const T*>(a.v.rows) + rv.r * a.v.r_row + h * a.v.r_col;
        for (int i = 0; i < HG; i++) {
          pr[i * SKB + nr] = sc[i * SKB + j];
          sc[i * SKB + j] = 0.f;
        }
      }
      scale_cols<HG>(sc, nb, fv + b0 * a.v.s_t, a.v.s_t, 1.f);
    }
    weigh_rows<HG, T>(sc, SKB, nb, ev + b0 * a.v.e_t, a.v.e_t, d, r, out);
    if (nr) weigh_ptrs<HG, T>(pr, SKB, nr, vp, d, ones, out);
  }
}

// dots[i][c] = q_i . RoPE(kr[c]) for HG rows q (stride d) and four slots: k = (lo cos - hi sin,
// hi cos + lo sin) of its halves lo, hi, with cs[c], sn[c] the first d / 2 of its position's
// table rows; the query's halves are loaded once for the four, and each head's four sums come
// out of one transposing reduction
template <int HG, typename T>
inline void rope_dots4(const float* q, int64_t d, const T* const* kr, const float* const* cs,
                       const float* const* sn, __m128* dots) {
  const int64_t hd = d / 2;
  __m256 a8[HG][4];
#if defined(__AVX512F__)
  __m512 acc[HG][4];
  for (int i = 0; i < HG; i++)
    for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
  for (int64_t e = 0; e < hd; e += 16) {
    __m512 ql[HG], qh[HG];
    for (int i = 0; i < HG; i++)
      ql[i] = _mm512_loadu_ps(q + i * d + e), qh[i] = _mm512_loadu_ps(q + i * d + hd + e);
    for (int c = 0; c < 4; c++) {
      const __m512 lo = ld16(kr[c] + e), hi = ld16(kr[c] + hd + e);
      const __m512 c16 = _mm512_loadu_ps(cs[c] + e), s16 = _mm512_loadu_ps(sn[c] + e);
      const __m512 klo = _mm512_fmsub_ps(lo, c16, _mm512_mul_ps(hi, s16));
      const __m512 khi = _mm512_fmadd_ps(hi, c16, _mm512_mul_ps(lo, s16));
      for (int i = 0; i < HG; i++)
        acc[i][c] = _mm512_fmadd_ps(qh[i], khi, _mm512_fmadd_ps(ql[i], klo, acc[i][c]));
    }
  }
  for (int i = 0; i < HG; i++)
    for (int c = 0; c < 4; c++) a8[i][c] = fold8(acc[i][c]);
#else
  for (int i = 0; i < HG; i++)
    for (int c = 0; c < 4; c++) a8[i][c] = _mm256_setzero_ps();
  for (int64_t e = 0; e < hd; e += 8)
    for (int c = 0; c < 4; c++) {
      const __m256 lo = ld8(kr[c] + e), hi = ld8(kr[c] + hd + e);
      const __m256 c8 = _mm256_loadu_ps(cs[c] + e), s8 = _mm256_loadu_ps(sn[c] + e);
      const __m256 klo = _mm256_fmsub_ps(lo, c8, _mm256_mul_ps(hi, s8));
      const __m256 khi = _mm256_fmadd_ps(hi, c8, _mm256_mul_ps(lo, s8));
      for (int i = 0; i < HG; i++)
        a8[i][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + hd + e), khi,
                                   _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + e), klo, a8[i][c]));
    }
#endif
  for (int i = 0; i < HG; i++) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a8[i][0], a8[i][1]),
                                    _mm256_hadd_ps(a8[i][2], a8[i][3]));
    dots[i] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
}

// n magnitudes of head h's slots s0.. as floats (f16 ones converted eight at a time)
inline void book_mags(const BookSide& b, int64_t h, int64_t s0, int64_t n, float* out) {
  if (b.mag == nullptr) {
    for (int64_t j = 0; j < n; j++) out[j] = 1.f;
    return;
  }
  int64_t j = 0;
  if (b.mag_elem == EL_F16 && b.m_s == 1) {
    const uint16_t* m = static_cast<const uint16_t*>(b.mag) + h * b.m_h + s0;
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + j))));
  }
  for (; j < n; j++) out[j] = book_mag(b, h, s0 + j);
}

// HG query rows (rows r0.. of head h) over codebook slots [j0, j0 + n)
template <int HG, typename T>
void codebook_heads(const CodebookArgs& a, int64_t h, int64_t r0, const float* q, int64_t j0,
                    int64_t n, float* out, float* mx, float* sm) {
  const int64_t d = a.d, hd = d / 2;
  float sc[HG * SKB], r[HG], mv[SKB];
  const T* vp[SKB];
  for (int i = 0; i < HG; i++) {
    mx[i] = -INFINITY;
    sm[i] = 0.f;
  }
  for (int64_t i = 0; i < HG * d; i++) out[i] = 0.f;
  int mbyte[HG], mbit[HG];  // each row's keep bit: query head (r0 + i) / tq of the group
  for (int i = 0; i < HG; i++) {
    const int64_t qh = (r0 + i) / a.tq;
    mbyte[i] = a.mask != nullptr ? (int)(qh / 8) : 0;
    mbit[i] = a.mask != nullptr ? (int)(qh % 8) : 0;
  }
  const T* kp[SKB];
  const float *cs[SKB], *sn[SKB];  // each slot's rows of the RoPE tables
  float mk[SKB];  // the keys' magnitudes times the scale
  for (int64_t b0 = j0; b0 < j0 + n; b0 += SKB) {
    const int64_t nb = std::min<int64_t>(SKB, j0 + n - b0);
    for (int64_t j = 0; j < nb; j++) {  // the block's rows first: their loads go out early
      const int64_t s = b0 + j;
      kp[j] = book_row<T>(a.k, h, s);
      vp[j] = book_row<T>(a.v, h, s);
      const int64_t p = a.pos[h * a.p_h + s * a.p_s] * a.cs_r;
      cs[j] = a.cos + p, sn[j] = a.sin + p;
    }
    book_mags(a.k, h, b0, nb, mk);
    book_mags(a.v, h, b0, nb, mv);
    for (int64_t j = 0; j < nb; j++) mk[j] *= a.scale;
    for (int64_t j = 0; j < std::min(PREFETCH, nb); j++) {  // the loop below asks for the rest
      _mm_prefetch(reinterpret_cast<const char*>(kp[j]), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vp[j]), _MM_HINT_T1);
    }
    const uint8_t* bits = a.mask != nullptr ? a.mask + h * a.k_h + b0 * a.k_s : nullptr;
    const bool bytes4 = bits != nullptr && a.k_s == 1;  // a slot's bits in one byte: 4 at once
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) {
      if (j + PREFETCH < nb) {  // gathered rows: the hardware cannot guess where they are
        for (int64_t f = j + PREFETCH; f < std::min(nb, j + PREFETCH + 4); f++) {
          for (int64_t c = 0; c < d * (int64_t)sizeof(T); c += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kp[f]) + c, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vp[f]) + c, _MM_HINT_T1);
          }
          for (int64_t c = 0; c < hd * 4; c += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(cs[f]) + c, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(sn[f]) + c, _MM_HINT_T0);
          }
        }
      }
      __m128 dots[HG];
      rope_dots4<HG, T>(q, d, kp + j, cs + j, sn + j, dots);
      const __m128 fs = _mm_loadu_ps(mk + j);
      __m128i keep4 = _mm_setzero_si128();
      if (bytes4) {
        int32_t w;
        std::memcpy(&w, bits + j, 4);
        keep4 = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(w));
      }
      for (int i = 0; i < HG; i++) {
        __m128 x = _mm_mul_ps(dots[i], fs);
        if (bits != nullptr) {
          __m128i hide;
          if (bytes4) {
            hide = _mm_cmpeq_epi32(_mm_and_si128(keep4, _mm_set1_epi32(1 << mbit[i])),
                                   _mm_setzero_si128());
          } else {
            const uint8_t* p = bits + j * a.k_s + mbyte[i];
            hide = _mm_setr_epi32(-!((p[0] >> mbit[i]) & 1), -!((p[a.k_s] >> mbit[i]) & 1),
                                  -!((p[2 * a.k_s] >> mbit[i]) & 1),
                                  -!((p[3 * a.k_s] >> mbit[i]) & 1));
          }
          x = _mm_blendv_ps(x, _mm_set1_ps(kNegInf), _mm_castsi128_ps(hide));
        }
        _mm_storeu_ps(sc + i * SKB + j, x);
      }
    }
    if (j < nb) {  // the last 1-3 slots: four again, the last one repeated
      const T* k4[4];
      const float *c4[4], *s4[4];
      for (int c = 0; c < 4; c++) {
        const int64_t t = std::min(j + c, nb - 1);
        k4[c] = kp[t], c4[c] = cs[t], s4[c] = sn[t];
      }
      __m128 dots[HG];
      rope_dots4<HG, T>(q, d, k4, c4, s4, dots);
      for (int i = 0; i < HG; i++) {
        alignas(16) float dot[4];
        _mm_store_ps(dot, dots[i]);
        for (int64_t t = j; t < nb; t++) {
          const bool keep = bits == nullptr || ((bits[t * a.k_s + mbyte[i]] >> mbit[i]) & 1);
          sc[i * SKB + t] = keep ? dot[t - j] * mk[t] : kNegInf;
        }
      }
    }
    softmax_block<HG>(sc, SKB, nb, mx, sm, r, mv);  // each weight times its value's magnitude
    weigh_ptrs<HG, T>(sc, SKB, nb, vp, d, r, out);
  }
}

// The first of n rows with the largest dot product with each of NU vectors u, against best
// and arg as they come (ties keep the earlier): the rows' dots a block at a time in
// scores_rows' four rows to one transposing reduction, then one compare per row and vector.

// For 4 rows at a time: the dots of NU vectors u (stride d) with each row's first m values
// (sc[a * ss + j]) and the row's own squares over them (nr[j]), one transposing reduction each
// (m a multiple of 16 on AVX-512, of 8 on AVX2)
template <int NU, typename T>
inline void head_dots(const float* u, int64_t d, const T* k, int64_t ks, int64_t t, int64_t m,
                      float* sc, int64_t ss, float* nr) {
  int64_t j = 0;
  for (; j + 4 <= t; j += 4) {
    __m256 a8[NU + 1][4];
    const T* kr = k + j * ks;
#if defined(__AVX512F__)
    __m512 acc[NU + 1][4];
    for (int a = 0; a <= NU; a++)
      for (int c = 0; c < 4; c++) acc[a][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < m; i += 16)
      for (int c = 0; c < 4; c++) {
        const __m512 kc = ld16(kr + c * ks + i);
        acc[NU][c] = _mm512_fmadd_ps(kc, kc, acc[NU][c]);
        for (int a = 0; a < NU; a++)
          acc[a][c] = _mm512_fmadd_ps(_mm512_loadu_ps(u + a * d + i), kc, acc[a][c]);
      }
    for (int a = 0; a <= NU; a++)
      for (int c = 0; c < 4; c++) a8[a][c] = fold8(acc[a][c]);
#else
    for (int a = 0; a <= NU; a++)
      for (int c = 0; c < 4; c++) a8[a][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i += 8)
      for (int c = 0; c < 4; c++) {
        const __m256 kc = ld8(kr + c * ks + i);
        a8[NU][c] = _mm256_fmadd_ps(kc, kc, a8[NU][c]);
        for (int a = 0; a < NU; a++)
          a8[a][c] = _mm256_fmadd_ps(_mm256_loadu_ps(u + a * d + i), kc, a8[a][c]);
      }
#endif
    for (int a = 0; a <= NU; a++) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a8[a][0], a8[a][1]),
                                      _mm256_hadd_ps(a8[a][2], a8[a][3]));
      _mm_storeu_ps(a < NU ? sc + a * ss + j : nr + j,
                    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
  }
  for (; j < t; j++) {
    const T* kr = k + j * ks;
    __m256 acc[NU + 1];
    for (int a = 0; a <= NU; a++) acc[a] = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i += 8) {
      const __m256 kc = ld8(kr + i);
      acc[NU] = _mm256_fmadd_ps(kc, kc, acc[NU]);
      for (int a = 0; a < NU; a++)
        acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(u + a * d + i), kc, acc[a]);
    }
    for (int a = 0; a < NU; a++) sc[a * ss + j] = hsum(acc[a]);
    nr[j] = hsum(acc[NU]);
  }
}

// u . x over d values (a multiple of 8), one row
template <typename T>
inline float row_dot1(const float* u, const T* x, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(u + i), ld8(x + i), acc);
  return hsum(acc);
}

// A stored row is a unit vector rounded to the book's type: its squared norm is below this (f16
// rounds each value by at most 2^-11 of it: 1.00098 at most)
constexpr float kUnitRow2 = 1.002f;

// best_rows_simd for a search that only needs the rows above `floor` (SpindleKV's theta): the
// rows' first half first, and a row goes on to its whole dot product only where that half's dot
// plus the Cauchy-Schwarz bound on the other half, ||u's other half|| * sqrt(kUnitRow2 - the
// row's squares over the first), could exceed floor. best and arg are exact where best > floor
// (a row that cannot pass floor is not compared; on real books under 1% of rows go on).
template <int NU, typename T>
void best_rows_above(const float* u, const T* book, int64_t stride, int64_t n, int64_t d,
                     float floor, float* best, int64_t* arg) {
  const int64_t m = d / 2;
  float rest[NU];  // ||u_a[m:]||
  for (int a = 0; a < NU; a++) {
    float s2 = 0.f;
    for (int64_t i = m; i < d; i++) s2 += u[a * d + i] * u[a * d + i];
    rest[a] = std::sqrt(s2);
  }
  const float cut = floor - 1e-4f;  // the bound's own rounding, well inside
  float sc[NU * SKB], nr[SKB];  // a block's last eight may run past its rows: masked (live)
  for (int64_t b0 = 0; b0 < n; b0 += SKB) {
    const int64_t nb = std::min<int64_t>(SKB, n - b0);
    head_dots<NU, T>(u, d, book + b0 * stride, stride, nb, m, sc, SKB, nr);
    for (int64_t j0 = 0; j0 < nb; j0 += 8) {  // eight rows' bounds at once; few rows pass
      const __m256 other = _mm256_sqrt_ps(
          _mm256_max_ps(_mm256_sub_ps(_mm256_set1_ps(kUnitRow2), _mm256_loadu_ps(nr + j0)),
                        _mm256_setzero_ps()));
      unsigned pass[NU];
      for (int a = 0; a < NU; a++) {
        const __m256 bound = _mm256_fmadd_ps(_mm256_set1_ps(rest[a]), other,
                                             _mm256_loadu_ps(sc + a * SKB + j0));
        const int live = nb - j0 < 8 ? (1 << (nb - j0)) - 1 : 0xFF;
        pass[a] = (unsigned)_mm256_movemask_ps(
                      _mm256_cmp_ps(bound, _mm256_set1_ps(cut), _CMP_GT_OQ)) & live;
      }
      for (int64_t j = j0; j < std::min<int64_t>(nb, j0 + 8); j++)  // in row order: ties keep
        for (int a = 0; a < NU; a++) {                                // the earlier row
          if (!((pass[a] >> (j - j0)) & 1)) continue;
          const float s = row_dot1(u + a * d, book + (b0 + j) * stride, d);
          if (s > best[a]) best[a] = s, arg[a] = b0 + j;
        }
    }
  }
}

template <int NU, typename T>
void best_rows_simd(const float* u, const T* book, int64_t stride, int64_t n, int64_t d,
                    float* best, int64_t* arg) {
  float sc[NU * SKB];
  for (int64_t b0 = 0; b0 < n; b0 += SKB) {
    const int64_t nb = std::min<int64_t>(SKB, n - b0);
    scores_rows<NU, T>(u, book + b0 * stride, stride, nb, d, 1.f, sc, SKB);
    for (int a = 0; a < NU; a++) {
      const float* s = sc + a * SKB;
      float bv = best[a];
      int64_t ba = -1;
      for (int64_t j = 0; j < nb; j++)
        if (s[j] > bv) bv = s[j], ba = j;
      if (ba >= 0) best[a] = bv, arg[a] = b0 + ba;
    }
  }
}
#endif  // __AVX2__

// The query rows of a head in groups of up to 3 rows, as even as may be (attn_chunk's split).
template <class F>
inline void row_groups(int64_t R, const F& f) {
  const int64_t groups = (R + 2) / 3;
  for (int64_t gi = 0, r0 = 0; gi < groups; gi++) {
    const int64_t hn = (R - r0) / (groups - gi) + ((R - r0) % (groups - gi) ? 1 : 0);
    f(r0, hn);
    r0 += hn;
  }
}

// MergedChunkFn: KV head h's R rows over merged tokens [j0, j0 + n)
void merged_chunk(const MergedArgs& a, int64_t h, int64_t j0, int64_t n, float* part, float* mx,
                  float* sm, float* scratch) {
  const bool f16 = a.elem == EL_F16;
#if defined(__AVX2__)
  if (a.d % 64 == 0) {
    const float* q = a.q + h * a.R * a.d;
    row_groups(a.R, [&](int64_t r0, int64_t hn) {
      const float* qh = q + r0 * a.d;
      float* o = part + r0 * a.d;
#define KVQ_MERGED(HG)                                                                   \
  f16 ? (a.unit ? merged_heads<HG, uint16_t, true>(a, h, qh, j0, n, o, mx + r0, sm + r0)  \
                : merged_heads_stream<HG, uint16_t>(a, h, qh, j0, n, o, mx + r0, sm + r0)) \
      : (a.unit ? merged_heads<HG, float, true>(a, h, qh, j0, n, o, mx + r0, sm + r0)     \
                : merged_heads<HG, float, false>(a, h, qh, j0, n, o, mx + r0, sm + r0))
      if (hn == 3) KVQ_MERGED(3);
      else if (hn == 2) KVQ_MERGED(2);
      else KVQ_MERGED(1);
#undef KVQ_MERGED
    });
    return;
  }
#endif
  if (f16) merged_portable<uint16_t>(a, h, j0, n, part, mx, sm, scratch);
  else merged_portable<float>(a, h, j0, n, part, mx, sm, scratch);
}

// CodebookChunkFn: KV head h's R rows over slots [j0, j0 + n)
void codebook_chunk(const CodebookArgs& a, int64_t h, int64_t j0, int64_t n, float* part,
                    float* mx, float* sm, float* scratch) {
  const bool f16 = a.elem == EL_F16;
#if defined(__AVX2__)
  if (a.d % 64 == 0) {
    const float* q = a.q + h * a.R * a.d;
    row_groups(a.R, [&](int64_t r0, int64_t hn) {
      const float* qh = q + r0 * a.d;
      float* o = part + r0 * a.d;
#define KVQ_BOOK(HG)                                                                     \
  f16 ? codebook_heads<HG, uint16_t>(a, h, r0, qh, j0, n, o, mx + r0, sm + r0)       \
      : codebook_heads<HG, float>(a, h, r0, qh, j0, n, o, mx + r0, sm + r0)
      if (hn == 3) KVQ_BOOK(3);
      else if (hn == 2) KVQ_BOOK(2);
      else KVQ_BOOK(1);
#undef KVQ_BOOK
    });
    return;
  }
#endif
  if (f16) codebook_portable<uint16_t>(a, h, j0, n, part, mx, sm, scratch);
  else codebook_portable<float>(a, h, j0, n, part, mx, sm, scratch);
}

// BestRowFn
void best_rows(const float* u, int64_t nu, const void* book, int elem, int64_t stride, int64_t n,
               int64_t d, float floor, float* best, int64_t* arg) {
  const bool f16 = elem == EL_F16;
#if defined(__AVX2__)
  if (d % 8 == 0) {
    // a floor the rows' unit norm can prune by (theta in (-1, 1]); else the whole search
    const bool above = floor > -1.f && floor <= 1.f && d % 32 == 0;
    for (int64_t a0 = 0; a0 < nu; a0 += 3) {  // 3 vectors a pass: 12 accumulators
      const int64_t k = std::min<int64_t>(3, nu - a0);
      const float* ua = u + a0 * d;
#define KVQ_BEST_T(NU, T)                                                                      \
  above ? best_rows_above<NU>(ua, static_cast<const T*>(book), stride, n, d, floor, best + a0,  \
                              arg + a0)                                                        \
        : best_rows_simd<NU>(ua, static_cast<const T*>(book), stride, n, d, best + a0, arg + a0)
#define KVQ_BEST(NU) f16 ? KVQ_BEST_T(NU, uint16_t) : KVQ_BEST_T(NU, float)
      if (k == 3) KVQ_BEST(3);
      else if (k == 2) KVQ_BEST(2);
      else KVQ_BEST(1);
#undef KVQ_BEST
#undef KVQ_BEST_T
    }
    return;
  }
#endif
  (void)floor;  // the portable search is whole
  if (f16)
    best_rows_portable(u, nu, static_cast<const uint16_t*>(book), stride, n, d, best, arg);
  else
    best_rows_portable(u, nu, static_cast<const float*>(book), stride, n, d, best, arg);
}
