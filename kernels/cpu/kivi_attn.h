// KIVI's packed body attended as it is stored (kvrun/kv/stores/kivi.py; the torch reference is
// kernels/kivi_decode.py's kivi_decode_ref). Keys are quantized per channel over groups of G
// tokens and kept block-major (a group's words, scales and zeros of every channel in one run,
// read as one stream): each key group's scales fold into the query once (qs_c = q_c * s_c, d products a
// row) and its zeros into one constant a row (sum_c q_c z_c), so a score is
// sum_c qs_c * code + constant. Values are quantized per token over groups of G channels: a
// probability is scaled by its value group's scale (p * s) and multiplies the codes, and
// sum_t p_t * zero is kept apart per group and added once at the end. Nothing of the body is
// dequantized. Included by qkernels.cpp after qstep.h (one copy per instruction set).
//
// AVX2: a word's codes are shifted into 8 lanes at once (vpsrlvd); 1- and 2-bit codes become
// floats by a table lookup on their low bits (vpermps: no mask and no conversion on the ports
// the multiply-adds use), 4-bit ones by a mask and a conversion, 8-bit ones by widening bytes.
// The codes of 8 tokens (keys) or 8 channels (values) are decoded once for up to 3 query rows.

// code i of a row of packed words, as kernels/kivi_pack.py's unpack_codes reads it
inline float kivi_code(const int32_t* w, int bits, int64_t i) {
  const int per = 32 / bits;
  return (float)(((uint32_t)w[i / per] >> ((i % per) * bits)) & ((1u << bits) - 1u));
}

// the softmax of a block of nb scores a row, s (r, kb) in place: masked (t >= lim), the running
// maximum and sum updated, alpha (r) the factor the row's earlier sums are to be scaled by
void kivi_softmax(int64_t r, int64_t nb, int64_t b0, const int64_t* lim, float* s, int64_t kb,
                  float* mx, float* sm, float* alpha) {
  for (int64_t i = 0; i < r; i++) {
    float* sr = s + i * kb;
    const int64_t e = lim == nullptr ? nb : std::max<int64_t>(0, std::min(nb, lim[i] - b0));
    float m = mx[i];
    int64_t j = 0;
#if defined(__AVX2__)
    __m256 mv = _mm256_set1_ps(m), m1 = mv, m2 = mv, m3 = mv;  // four chains: max's latency
    for (; j + 32 <= e; j += 32) {
      mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + j));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(sr + j + 8));
      m2 = _mm256_max_ps(m2, _mm256_loadu_ps(sr + j + 16));
      m3 = _mm256_max_ps(m3, _mm256_loadu_ps(sr + j + 24));
    }
    mv = _mm256_max_ps(_mm256_max_ps(mv, m1), _mm256_max_ps(m2, m3));
    for (; j + 8 <= e; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; j < e; j++) m = sr[j] > m ? sr[j] : m;
    if (m == -INFINITY) {  // nothing visible yet: weights 0, the row stays empty
      alpha[i] = 1.f;
      for (int64_t j = 0; j < nb; j++) sr[j] = 0.f;
      continue;
    }
    alpha[i] = std::exp(mx[i] - m);  // 0 on the first visible block (exp(-inf))
    float total = 0.f;
    j = 0;
#if defined(__AVX512F__)
    __m512 tw = _mm512_setzero_ps();
    for (; j + 16 <= e; j += 16) {
      const __m512 x = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(m)));
      _mm512_storeu_ps(sr + j, x);
      tw = _mm512_add_ps(tw, x);
    }
    total = _mm512_reduce_add_ps(tw);
#endif
#if defined(__AVX2__)
    __m256 tv = _mm256_setzero_ps();
    for (; j + 8 <= e; j += 8) {
      const __m256 x = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), _mm256_set1_ps(m)));
      _mm256_storeu_ps(sr + j, x);
      tv = _mm256_add_ps(tv, x);
    }
    total += hsum(tv);
#endif
    for (; j < e; j++) {
      sr[j] = std::exp(sr[j] - m);
      total += sr[j];
    }
    for (j = e; j < nb; j++) sr[j] = 0.f;
    sm[i] = sm[i] * alpha[i] + total;
    mx[i] = m;
  }
}

// pw (r, kb, d / G) = p * the value group's scale; zs (r, d / G) = zs * alpha + sum_t p * zero.
// A block's scales and zeros are (nb, d / G) rows; where they are contiguous, p is repeated
// d / G times and multiplies them as they lie.
template <typename S>
void kivi_value_weights(int64_t r, int64_t nb, int64_t b0, const KiviHead& b, int64_t gd,
                        const float* p, int64_t kb, const float* alpha, float* pw, float* zs) {
  const S* vs = b.vscale<S>() + b0 * b.vs_t;
  const S* vz = b.vzero<S>() + b0 * b.vz_t;
  for (int64_t i = 0; i < r; i++) {
    const float* pi = p + i * kb;
    float* w = pw + i * kb * gd;
    float* z = zs + i * gd;
    for (int64_t g = 0; g < gd; g++) z[g] *= alpha[i];
    int64_t j = 0;
#if defined(__AVX2__)
    if (gd == 1 && b.vs_t == 1 && b.vz_t == 1) {
      __m256 za = _mm256_setzero_ps();
      for (; j + 8 <= nb; j += 8) {
        const __m256 pv = _mm256_loadu_ps(pi + j);
        _mm256_storeu_ps(w + j, _mm256_mul_ps(pv, ld8(vs + j)));
        za = _mm256_fmadd_ps(pv, ld8(vz + j), za);
      }
      z[0] += hsum(za);
    } else if (gd == 2 && b.vs_t == 2 && b.vz_t == 2) {  // p0 p0 p1 p1 ... against (token, group) pairs
      __m256 za = _mm256_setzero_ps();
      for (; j + 8 <= nb; j += 8) {
        const __m256 pv = _mm256_loadu_ps(pi + j);
        const __m256 lo = _mm256_unpacklo_ps(pv, pv), hi = _mm256_unpackhi_ps(pv, pv);
        const __m256 e0 = _mm256_permute2f128_ps(lo, hi, 0x20);
        const __m256 e1 = _mm256_permute2f128_ps(lo, hi, 0x31);
        _mm256_storeu_ps(w + 2 * j, _mm256_mul_ps(e0, ld8(vs + 2 * j)));
        _mm256_storeu_ps(w + 2 * j + 8, _mm256_mul_ps(e1, ld8(vs + 2 * j + 8)));
        za = _mm256_fmadd_ps(e0, ld8(vz + 2 * j), za);
        za = _mm256_fmadd_ps(e1, ld8(vz + 2 * j + 8), za);
      }
      alignas(32) float lane[8];
      _mm256_store_ps(lane, za);
      z[0] += (lane[0] + lane[2]) + (lane[4] + lane[6]);
      z[1] += (lane[1] + lane[3]) + (lane[5] + lane[7]);
    }
#endif
    for (; j < nb; j++) {
      const float pj = pi[j];
      for (int64_t g = 0; g < gd; g++) {
        w[j * gd + g] = pj * ld1(vs + j * b.vs_t + g);
        z[g] += pj * ld1(vz + j * b.vz_t + g);
      }
    }
  }
}

// qs (r, d) = q * a key group's scales cs (d), zc (r) = q . its zeros cz (d)
template <typename S>
void kivi_fold(const float* q, int64_t r, int64_t d, const S* cs, const S* cz, float* qs,
               float* zc) {
#if defined(__AVX512F__)
  if (d % 16 == 0) {  // 16 lanes, one reduction a row
    for (int64_t i = 0; i < r; i++) {
      const float* qi = q + i * d;
      __m512 za = _mm512_setzero_ps();
      for (int64_t c = 0; c < d; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qi + c);
        _mm512_storeu_ps(qs + i * d + c, _mm512_mul_ps(qv, ld16(cs + c)));
        za = _mm512_fmadd_ps(qv, ld16(cz + c), za);
      }
      zc[i] = _mm512_reduce_add_ps(za);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < r; i++) {
    const float* qi = q + i * d;
    float z = 0.f;
    int64_t c = 0;
#if defined(__AVX2__)
    __m256 za = _mm256_setzero_ps();
    for (; c + 8 <= d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qi + c);
      _mm256_storeu_ps(qs + i * d + c, _mm256_mul_ps(qv, ld8(cs + c)));
      za = _mm256_fmadd_ps(qv, ld8(cz + c), za);
    }
    z = hsum(za);
#endif
    for (; c < d; c++) {
      qs[i * d + c] = qi[c] * ld1(cs + c);
      z += qi[c] * ld1(cz + c);
    }
    zc[i] = z;
  }
}

// scores s (r, kb) of body tokens [b0, b0 + nb), portable
template <typename S>
void kivi_scores_portable(const float* q, int64_t r, const KiviHead& b, int bits, int G,
                          int64_t b0, int64_t nb, int64_t d, float* s, int64_t kb, float* qs,
                          float* zc) {
  for (int64_t g0 = 0; g0 < nb; g0 += G) {
    const int64_t gi = (b0 + g0) / G;
    kivi_fold(q, r, d, b.kscale<S>() + gi * b.ks_g, b.kzero<S>() + gi * b.kz_g, qs, zc);
    const int32_t* kw = b.kc + gi * b.kc_g;  // the group's words
    for (int64_t i = 0; i < r; i++)
      for (int64_t t = 0; t < G; t++) {
        float acc = 0.f;
        for (int64_t c = 0; c < d; c++) acc += qs[i * d + c] * kivi_code(kw + c * b.kc_c, bits, t);
        s[i * kb + g0 + t] = acc + zc[i];
      }
  }
}

// out (r, d) = out * alpha + sum_t pw * codes, portable
void kivi_values_portable(int64_t r, const KiviHead& b, int bits, int G, int64_t b0, int64_t nb,
                          int64_t d, const float* pw, int64_t kb, const float* alpha, float* out) {
  const int64_t gd = d / G;
  for (int64_t i = 0; i < r; i++)
    for (int64_t c = 0; c < d; c++) out[i * d + c] *= alpha[i];
  for (int64_t j = 0; j < nb; j++) {
    const int32_t* w = b.vc + (b0 + j) * b.vc_t;
    for (int64_t i = 0; i < r; i++)
      for (int64_t c = 0; c < d; c++)
        out[i * d + c] += pw[(i * kb + j) * gd + c / G] * kivi_code(w, bits, c);
  }
}

#if defined(__AVX2__)
// where codes i0 .. i0 + 7 of a row of words start: a word (a byte for 8 bits) and lane shifts
template <int B>
inline void kivi_where(int64_t i0, int64_t& at, __m256i& shift) {
  if constexpr (B == 8) {
    at = i0;
    shift = _mm256_setzero_si256();
  } else {
    constexpr int PER = 32 / B;
    at = i0 / PER;
    shift = _mm256_add_epi32(_mm256_set1_epi32((int)(i0 % PER) * B),
                             _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B));
  }
}

// the 8 codes kivi_where found, as floats
template <int B>
inline __m256 kivi_code8(const int32_t* w, int64_t at, __m256i shift) {
  if constexpr (B == 8) {
    const __m128i x = _mm_loadl_epi64((const __m128i*)((const uint8_t*)w + at));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
  } else {
    const __m256i x = _mm256_srlv_epi32(_mm256_set1_epi32(w[at]), shift);
    if constexpr (B == 4) return _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    // lanes' low 3 bits index a table repeating the 2^B codes
    const __m256 tab = B == 1 ? _mm256_setr_ps(0.f, 1.f, 0.f, 1.f, 0.f, 1.f, 0.f, 1.f)
                              : _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 0.f, 1.f, 2.f, 3.f);
    return _mm256_permutevar8x32_ps(tab, x);
  }
}

// s[i * kb + 8 * v + lane] = sum_c qs[i * d + c] * code(c, t0 + 8 * v + lane) + zc[i] for RB
// rows and TB vectors of 8 tokens of one key group, whose words kw holds (t0 within it)
template <int B, int RB, int TB>
inline void kivi_keys_tile(const float* qs, int64_t d, const int32_t* kw, int64_t wc, int64_t t0,
                           const float* zc, float* s, int64_t kb) {
  __m256 acc[RB][TB];
  int64_t at[TB];
  __m256i sh[TB];
#pragma GCC unroll 4
  for (int v = 0; v < TB; v++) kivi_where<B>(t0 + 8 * v, at[v], sh[v]);
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++) acc[i][v] = _mm256_setzero_ps();
  const int32_t* w = kw;
  for (int64_t c = 0; c < d; c++, w += wc) {
    __m256 qb[RB];
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) qb[i] = _mm256_broadcast_ss(qs + i * d + c);
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++) {
      const __m256 cv = kivi_code8<B>(w, at[v], sh[v]);
#pragma GCC unroll 4
      for (int i = 0; i < RB; i++) acc[i][v] = _mm256_fmadd_ps(qb[i], cv, acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++)
      _mm256_storeu_ps(s + i * kb + 8 * v, _mm256_add_ps(acc[i][v], _mm256_set1_ps(zc[i])));
}

// the key group starting at token t0
template <int B, int RB>
inline void kivi_keys_rows(const float* qs, int64_t d, const KiviHead& b, int64_t t0, int G,
                           const float* zc, float* s, int64_t kb) {
  const int32_t* kw = b.kc + t0 / G * b.kc_g;
  int v = 0;
  for (; v + 2 <= G / 8; v += 2) kivi_keys_tile<B, RB, 2>(qs, d, kw, b.kc_c, 8 * v, zc, s + 8 * v, kb);
  if (v < G / 8) kivi_keys_tile<B, RB, 1>(qs, d, kw, b.kc_c, 8 * v, zc, s + 8 * v, kb);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// AVX-512 (its builds): the same tiles 16 lanes wide; 4-bit codes by a 16-entry lookup too.
// 4-bit codes come interleaved: the two words of 16 codes are broadcast as one 64-bit pair, so
// lane 2j holds code j and lane 2j + 1 code 8 + j (a load, a shift and the lookup: no lane
// permute per word); the tiles put their lanes back in order once, at their ends (kivi_il16)
template <int B>
inline void kivi_where16(int64_t i0, int64_t& at, __m512i& shift) {
  if constexpr (B == 8) {
    at = i0;
    shift = _mm512_setzero_si512();
  } else if constexpr (B == 4) {
    at = i0 / 8;  // two words, interleaved across the lanes
    shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  } else {
    constexpr int PER = 32 / B;
    at = i0 / PER;
    shift = _mm512_add_epi32(_mm512_set1_epi32((int)(i0 % PER) * B),
                             _mm512_mullo_epi32(_mm512_set1_epi32(B),
                                                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                  11, 12, 13, 14, 15)));
  }
}

template <int B>
inline __m512 kivi_code16(const int32_t* w, int64_t at, __m512i shift) {
  if constexpr (B == 8) {
    const __m128i x = _mm_loadu_si128((const __m128i*)((const uint8_t*)w + at));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
  } else {
    __m512i x;
    if constexpr (B == 4) {
      int64_t pair;
      std::memcpy(&pair, w + at, sizeof(pair));
      x = _mm512_set1_epi64(pair);  // words (w[at], w[at + 1]) in lanes (2j, 2j + 1)
    } else {
      x = _mm512_set1_epi32(w[at]);
    }
    x = _mm512_srlv_epi32(x, shift);
    // lanes' low 4 bits index a table repeating the 2^B codes
    const __m512 tab = B == 1 ? _mm512_setr_ps(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1)
                     : B == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                              : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(x, tab);
  }
}

// 16 lanes of interleaved 4-bit codes' order (lane 2j: element j, 2j + 1: element 8 + j) put
// in order (to = true) or the other way round
template <int B>
inline __m512 kivi_il16(__m512 x, bool to) {
  if constexpr (B != 4) return x;
  const __m512i in_order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m512i interleave = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_ps(to ? in_order : interleave, x);
}

template <int B, int RB, int TB>
inline void kivi_keys_tile16(const float* qs, int64_t d, const int32_t* kw, int64_t wc,
                             int64_t t0, const float* zc, float* s, int64_t kb) {
  __m512 acc[RB][TB];
  int64_t at[TB];
  __m512i sh[TB];
#pragma GCC unroll 4
  for (int v = 0; v < TB; v++) kivi_where16<B>(t0 + 16 * v, at[v], sh[v]);
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++) acc[i][v] = _mm512_setzero_ps();
  const int32_t* w = kw;
  for (int64_t c = 0; c < d; c++, w += wc) {
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++) {
      const __m512 cv = kivi_code16<B>(w, at[v], sh[v]);
#pragma GCC unroll 4
      for (int i = 0; i < RB; i++)
        acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * d + c]), cv, acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < TB; v++)
      _mm512_storeu_ps(s + i * kb + 16 * v,
                       _mm512_add_ps(kivi_il16<B>(acc[i][v], true), _mm512_set1_ps(zc[i])));
}

template <int B, int RB>
inline void kivi_keys_rows16(const float* qs, int64_t d, const KiviHead& b, int64_t t0, int G,
                             const float* zc, float* s, int64_t kb) {
  const int32_t* kw = b.kc + t0 / G * b.kc_g;
  const int64_t wc = b.kc_c;
  int v = 0;
  for (; v + 4 <= G / 16; v += 4) kivi_keys_tile16<B, RB, 4>(qs, d, kw, wc, 16 * v, zc, s + 16 * v, kb);
  for (; v + 2 <= G / 16; v += 2) kivi_keys_tile16<B, RB, 2>(qs, d, kw, wc, 16 * v, zc, s + 16 * v, kb);
  if (v < G / 16) kivi_keys_tile16<B, RB, 1>(qs, d, kw, wc, 16 * v, zc, s + 16 * v, kb);
}

template <int B, int RB, int CV>
inline void kivi_values_tile16(const KiviHead& b, int G, int64_t b0, int64_t nb, int64_t c0,
                               int64_t d, const float* pw, int64_t kb, int64_t gd,
                               const float* alpha, float* out) {
  __m512 acc[RB][CV];
  int64_t at[CV], grp[CV];
  __m512i sh[CV];
#pragma GCC unroll 4
  for (int v = 0; v < CV; v++) {
    kivi_where16<B>(c0 + 16 * v, at[v], sh[v]);
    grp[v] = (c0 + 16 * v) / G;
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++)
      acc[i][v] = _mm512_mul_ps(kivi_il16<B>(_mm512_loadu_ps(out + i * d + c0 + 16 * v), false),
                                _mm512_set1_ps(alpha[i]));
  const int32_t* w = b.vc + b0 * b.vc_t;
  const int64_t wt = b.vc_t;
  const float* pr[RB];  // each row's weights of token j, by group
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++) pr[i] = pw + i * kb * gd;
  for (int64_t j = 0; j < nb; j++, w += wt) {
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++) {
      const __m512 cv = kivi_code16<B>(w, at[v], sh[v]);
#pragma GCC unroll 4
      for (int i = 0; i < RB; i++)
        acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(pr[i][grp[v]]), cv, acc[i][v]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < RB; i++) pr[i] += gd;
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++)
      _mm512_storeu_ps(out + i * d + c0 + 16 * v, kivi_il16<B>(acc[i][v], true));
}

template <int B, int RB>
inline void kivi_values_rows16(const KiviHead& b, int G, int64_t b0, int64_t nb, int64_t d,
                               const float* pw, int64_t kb, int64_t gd, const float* alpha,
                               float* out) {
  int64_t c0 = 0;
  for (; c0 + 64 <= d; c0 += 64)
    kivi_values_tile16<B, RB, 4>(b, G, b0, nb, c0, d, pw, kb, gd, alpha, out);
  for (; c0 + 32 <= d; c0 += 32)
    kivi_values_tile16<B, RB, 2>(b, G, b0, nb, c0, d, pw, kb, gd, alpha, out);
  if (c0 < d) kivi_values_tile16<B, RB, 1>(b, G, b0, nb, c0, d, pw, kb, gd, alpha, out);
}
#define KIVI_WIDE 1
#else
#define KIVI_WIDE 0
#endif

// the value rows, scales and zeros of tokens [t0, t0 + n) asked for while their keys are scored:
// the value pass after the block's softmax finds them in L1 instead of waiting on each stream
// (six a head, more than the hardware's stream prefetch keeps ahead of): kivi2 1.03x -> 1.09x
// and kivi4 0.97x -> 1.04x `full` at 8,000 tokens on AVX2 (bench/NOTES.md, 2026-12-07)
template <typename S>
inline void kivi_prefetch_values(const KiviHead& b, int64_t t0, int64_t n) {
  const char* vc = (const char*)(b.vc + t0 * b.vc_t);
  for (int64_t o = 0; o < n * b.vc_t * 4; o += 64) _mm_prefetch(vc + o, _MM_HINT_T0);
  const char* vs = (const char*)(b.vscale<S>() + t0 * b.vs_t);
  const char* vz = (const char*)(b.vzero<S>() + t0 * b.vz_t);
  for (int64_t o = 0; o < n * b.vs_t * (int64_t)sizeof(S); o += 64) {
    _mm_prefetch(vs + o, _MM_HINT_T0);
    _mm_prefetch(vz + o, _MM_HINT_T0);
  }
}

template <int B, typename S>
void kivi_scores_avx2(const float* q, int64_t r, const KiviHead& b, int G, int64_t b0,
                      int64_t nb, int64_t d, float* s, int64_t kb, float* qs, float* zc) {
  for (int64_t g0 = 0; g0 < nb; g0 += G) {
    const int64_t gi = (b0 + g0) / G;
    kivi_prefetch_values<S>(b, b0 + g0, G);
    kivi_fold(q, r, d, b.kscale<S>() + gi * b.ks_g, b.kzero<S>() + gi * b.kz_g, qs, zc);
    for (int64_t i = 0; i < r; i += 3) {
      const int64_t t0 = b0 + g0;
      float* si = s + i * kb + g0;
#if KIVI_WIDE
      if (G % 16 == 0) {
        if (r - i >= 3) kivi_keys_rows16<B, 3>(qs + i * d, d, b, t0, G, zc + i, si, kb);
        else if (r - i == 2) kivi_keys_rows16<B, 2>(qs + i * d, d, b, t0, G, zc + i, si, kb);
        else kivi_keys_rows16<B, 1>(qs + i * d, d, b, t0, G, zc + i, si, kb);
        continue;
      }
#endif
      if (r - i >= 3) kivi_keys_rows<B, 3>(qs + i * d, d, b, t0, G, zc + i, si, kb);
      else if (r - i == 2) kivi_keys_rows<B, 2>(qs + i * d, d, b, t0, G, zc + i, si, kb);
      else kivi_keys_rows<B, 1>(qs + i * d, d, b, t0, G, zc + i, si, kb);
    }
  }
}

// out[i * d + c0 + 8 * v + lane] = out * alpha[i] + sum_t pw(i, t, group) * code(t, channel)
// for RB rows and CV vectors of 8 channels
template <int B, int RB, int CV>
inline void kivi_values_tile(const KiviHead& b, int G, int64_t b0, int64_t nb, int64_t c0,
                             int64_t d, const float* pw, int64_t kb, int64_t gd,
                             const float* alpha, float* out) {
  __m256 acc[RB][CV];
  int64_t at[CV], grp[CV];
  __m256i sh[CV];
#pragma GCC unroll 4
  for (int v = 0; v < CV; v++) {
    kivi_where<B>(c0 + 8 * v, at[v], sh[v]);
    grp[v] = (c0 + 8 * v) / G;
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++)
      acc[i][v] = _mm256_mul_ps(_mm256_loadu_ps(out + i * d + c0 + 8 * v), _mm256_set1_ps(alpha[i]));
  const int32_t* w = b.vc + b0 * b.vc_t;
  const int64_t wt = b.vc_t, ld = kb * gd;
  const float* p = pw;
  for (int64_t j = 0; j < nb; j++, w += wt, p += gd) {
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++) {
      const __m256 cv = kivi_code8<B>(w, at[v], sh[v]);
#pragma GCC unroll 4
      for (int i = 0; i < RB; i++)
        acc[i][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * ld + grp[v]), cv, acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < RB; i++)
#pragma GCC unroll 4
    for (int v = 0; v < CV; v++) _mm256_storeu_ps(out + i * d + c0 + 8 * v, acc[i][v]);
}

template <int B, int RB>
inline void kivi_values_rows(const KiviHead& b, int G, int64_t b0, int64_t nb, int64_t d,
                             const float* pw, int64_t kb, int64_t gd, const float* alpha,
                             float* out) {
  int64_t c0 = 0;
  for (; c0 + 16 <= d; c0 += 16)
    kivi_values_tile<B, RB, 2>(b, G, b0, nb, c0, d, pw, kb, gd, alpha, out);
  if (c0 < d) kivi_values_tile<B, RB, 1>(b, G, b0, nb, c0, d, pw, kb, gd, alpha, out);
}

template <int B>
void kivi_values_avx2(int64_t r, const KiviHead& b, int G, int64_t b0, int64_t nb, int64_t d,
                      const float* pw, int64_t kb, const float* alpha, float* out) {
  const int64_t gd = d / G;
  for (int64_t i = 0; i < r; i += 3) {
    const float* p = pw + i * kb * gd;
    float* o = out + i * d;
#if KIVI_WIDE
    if (G % 16 == 0 && d % 16 == 0) {
      if (r - i >= 3) kivi_values_rows16<B, 3>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
      else if (r - i == 2) kivi_values_rows16<B, 2>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
      else kivi_values_rows16<B, 1>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
      continue;
    }
#endif
    if (r - i >= 3) kivi_values_rows<B, 3>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
    else if (r - i == 2) kivi_values_rows<B, 2>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
    else kivi_values_rows<B, 1>(b, G, b0, nb, d, p, kb, gd, alpha + i, o);
  }
}
#endif  // __AVX2__

// minicache+kivi4 (KiviHead's merged fields): a block's scores times its tokens' factors
// (kf * kfi), a retained token's score its exact row's (q is already scaled)
void kivi_merged_keys(const float* q, int64_t r, const KiviHead& b, int64_t b0, int64_t nb,
                      int64_t d, float* s, int64_t kb) {
  const float *f = b.kf + b0, *fi = b.kfi + b0;
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < nb; j++) s[i * kb + j] *= f[j] * fi[j];
  const int32_t* end = b.kr + b.nk;
  for (const int32_t* p = std::lower_bound(b.kr, end, (int32_t)b0); p < end && *p < b0 + nb; p++) {
    const float* row = b.krow + (p - b.kr) * d;
    for (int64_t i = 0; i < r; i++) {
      float acc = 0.f;
      for (int64_t c = 0; c < d; c++) acc += q[i * d + c] * row[c];
      s[i * kb + *p - b0] = acc;
    }
  }
}

// the same for a block's weights p (r, kb) after its softmax: the retained tokens' weights moved
// to ps (count, r) and zeroed, every weight times vf; -> the count, *first the first of them
int64_t kivi_merged_weights(int64_t r, const KiviHead& b, int64_t b0, int64_t nb, float* s,
                            int64_t kb, float* ps, const int32_t** first) {
  const int32_t* end = b.vr + b.nv;
  const int32_t* lo = std::lower_bound(b.vr, end, (int32_t)b0);
  const int32_t* hi = std::lower_bound(lo, end, (int32_t)(b0 + nb));
  for (const int32_t* p = lo; p < hi; p++)
    for (int64_t i = 0; i < r; i++) {
      ps[(p - lo) * r + i] = s[i * kb + *p - b0];
      s[i * kb + *p - b0] = 0.f;
    }
  const float *f = b.vf + b0, *fi = b.vfi + b0;
  for (int64_t i = 0; i < r; i++)
    for (int64_t j = 0; j < nb; j++) s[i * kb + j] *= f[j] * fi[j];
  *first = lo;
  return hi - lo;
}

// KiviChunkFn: blocks of about 256 tokens (kivi_block), each scored, softmaxed and weighed in
// turn; S the scales' and zeros' element (float, or float16 bits)
template <typename S>
void kivi_chunk_as(const float* q, int64_t r, const KiviHead& b, int bits, int G, int64_t j0,
                   int64_t n, int64_t d, const int64_t* lim, float* out, float* mx, float* sm,
                   float* scratch) {
  const int64_t kb = kivi_block(G), gd = d / G;
  float* s = scratch;       // (r, kb) scores, then weights
  float* qs = s + r * kb;   // (r, d) the query with a group's scales folded in
  float* zc = qs + r * d;   // (r) q . a group's zeros
  float* alpha = zc + r;    // (r)
  float* pw = alpha + r;    // (r, kb, d / G) weights times value scales
  float* zs = pw + r * kb * gd;  // (r, d / G) sum of weights times value zeros
  float* ps = zs + r * gd;       // (kb, r) a merged pair's retained value rows' weights
  const bool merged = b.kf != nullptr;
  for (int64_t i = 0; i < r; i++) {
    mx[i] = -INFINITY;
    sm[i] = 0.f;
  }
  for (int64_t i = 0; i < r * d; i++) out[i] = 0.f;
  for (int64_t i = 0; i < r * gd; i++) zs[i] = 0.f;
#if defined(__AVX2__)
  const bool simd = d % 8 == 0 && G % 8 == 0;
#endif
  for (int64_t b0 = j0; b0 < j0 + n; b0 += kb) {
    const int64_t nb = std::min(kb, j0 + n - b0);
#if defined(__AVX2__)
    if (simd) {
      switch (bits) {
        case 1: kivi_scores_avx2<1, S>(q, r, b, G, b0, nb, d, s, kb, qs, zc); break;
        case 2: kivi_scores_avx2<2, S>(q, r, b, G, b0, nb, d, s, kb, qs, zc); break;
        case 4: kivi_scores_avx2<4, S>(q, r, b, G, b0, nb, d, s, kb, qs, zc); break;
        default: kivi_scores_avx2<8, S>(q, r, b, G, b0, nb, d, s, kb, qs, zc); break;
      }
    } else
#endif
      kivi_scores_portable<S>(q, r, b, bits, G, b0, nb, d, s, kb, qs, zc);
    if (merged) kivi_merged_keys(q, r, b, b0, nb, d, s, kb);
    kivi_softmax(r, nb, b0, lim, s, kb, mx, sm, alpha);
    const int32_t* vr0 = nullptr;
    const int64_t nvr = merged ? kivi_merged_weights(r, b, b0, nb, s, kb, ps, &vr0) : 0;
    kivi_value_weights<S>(r, nb, b0, b, gd, s, kb, alpha, pw, zs);
#if defined(__AVX2__)
    if (simd) {
      switch (bits) {
        case 1: kivi_values_avx2<1>(r, b, G, b0, nb, d, pw, kb, alpha, out); break;
        case 2: kivi_values_avx2<2>(r, b, G, b0, nb, d, pw, kb, alpha, out); break;
        case 4: kivi_values_avx2<4>(r, b, G, b0, nb, d, pw, kb, alpha, out); break;
        default: kivi_values_avx2<8>(r, b, G, b0, nb, d, pw, kb, alpha, out); break;
      }
    } else
#endif
      kivi_values_portable(r, b, bits, G, b0, nb, d, pw, kb, alpha, out);
    for (int64_t k = 0; k < nvr; k++) {  // a merged pair's retained value rows, exact
      const float* row = b.vrow + (vr0 - b.vr + k) * d;
      for (int64_t i = 0; i < r; i++) {
        const float w = ps[k * r + i];
        for (int64_t c = 0; c < d; c++) out[i * d + c] += w * row[c];
      }
    }
  }
  for (int64_t i = 0; i < r; i++)  // each value group's zeros, a group's G channels at a time
    for (int64_t g = 0; g < gd; g++) {
      float* o = out + i * d + g * G;
      const float z = zs[i * gd + g];
      for (int64_t c = 0; c < G; c++) o[c] += z;
    }
}

void kivi_chunk(const float* q, int64_t r, const KiviHead& b, int bits, int G, int64_t j0,
                int64_t n, int64_t d, const int64_t* lim, float* out, float* mx, float* sm,
                float* scratch) {
  if (b.half) kivi_chunk_as<uint16_t>(q, r, b, bits, G, j0, n, d, lim, out, mx, sm, scratch);
  else kivi_chunk_as<float>(q, r, b, bits, G, j0, n, d, lim, out, mx, sm, scratch);
}

#if defined(__AVX2__)
// 8x8 floats transposed in registers
inline void kivi_transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// kivi_dequant 8 channels by 8 tokens at a time (keys transposed in registers), 8 channels of
// a token at a time (values); a product, then a sum, as the reference
template <int B, typename S>
void kivi_dequant_avx2(const KiviHead& b, int G, int64_t t0, int64_t n, int64_t d, float* k,
                       float* v) {
  for (int64_t t = 0; t < n; t += 8) {
    const int64_t g = (t0 + t) / G;
    const int32_t* kw = b.kc + g * b.kc_g;
    const S *ks = b.kscale<S>() + g * b.ks_g, *kz = b.kzero<S>() + g * b.kz_g;
    int64_t at;
    __m256i sh;
    kivi_where<B>((t0 + t) % G, at, sh);
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; i++) {
        const int64_t c = c0 + i;
        const __m256 x = kivi_code8<B>(kw + c * b.kc_c, at, sh);
        r[i] = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(ld1(ks + c))), _mm256_set1_ps(ld1(kz + c)));
      }
      kivi_transpose8(r);
      for (int i = 0; i < 8; i++) _mm256_storeu_ps(k + (t + i) * d + c0, r[i]);
    }
  }
  for (int64_t t = 0; t < n; t++) {
    const int32_t* w = b.vc + (t0 + t) * b.vc_t;
    const S* vs = b.vscale<S>() + (t0 + t) * b.vs_t;
    const S* vz = b.vzero<S>() + (t0 + t) * b.vz_t;
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      int64_t at;
      __m256i sh;
      kivi_where<B>(c0, at, sh);
      const __m256 x = kivi_code8<B>(w, at, sh);
      const __m256 y = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(ld1(vs + c0 / G))),
                                     _mm256_set1_ps(ld1(vz + c0 / G)));
      _mm256_storeu_ps(v + t * d + c0, y);
    }
  }
}
#endif

// KiviDequantFn's work, S the scales' and zeros' element
template <typename S>
void kivi_dequant_as(const KiviHead& b, int bits, int G, int64_t t0, int64_t n, int64_t d,
                     float* k, float* v) {
#if defined(__AVX2__)
  if (d % 8 == 0 && G % 8 == 0) {
    switch (bits) {
      case 1: return kivi_dequant_avx2<1, S>(b, G, t0, n, d, k, v);
      case 2: return kivi_dequant_avx2<2, S>(b, G, t0, n, d, k, v);
      case 4: return kivi_dequant_avx2<4, S>(b, G, t0, n, d, k, v);
      default: return kivi_dequant_avx2<8, S>(b, G, t0, n, d, k, v);
    }
  }
#endif
  const S *ks = b.kscale<S>(), *kz = b.kzero<S>();
  for (int64_t c = 0; c < d; c++)
    for (int64_t t = 0; t < n; t++) {
      const int64_t g = (t0 + t) / G;
      const float s = ld1(ks + g * b.ks_g + c), z = ld1(kz + g * b.kz_g + c);
      k[t * d + c] = kivi_code(b.kc + g * b.kc_g + c * b.kc_c, bits, (t0 + t) % G) * s + z;
    }
  for (int64_t t = 0; t < n; t++) {
    const int32_t* w = b.vc + (t0 + t) * b.vc_t;
    const S* vs = b.vscale<S>() + (t0 + t) * b.vs_t;
    const S* vz = b.vzero<S>() + (t0 + t) * b.vz_t;
    for (int64_t c = 0; c < d; c++)
      v[t * d + c] = kivi_code(w, bits, c) * ld1(vs + c / G) + ld1(vz + c / G);
  }
}

// KiviDequantFn
void kivi_dequant(const KiviHead& b, int bits, int G, int64_t t0, int64_t n, int64_t d, float* k,
                  float* v) {
  if (b.half) kivi_dequant_as<uint16_t>(b, bits, G, t0, n, d, k, v);
  else kivi_dequant_as<float>(b, bits, G, t0, n, d, k, v);
}
