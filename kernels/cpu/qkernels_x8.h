// Products over the 8-row interleaved layout (qlayout.h), included by qkernels.cpp inside its
// anonymous namespace (one copy per instruction set).
//
// Each 32-byte load holds 4 codes of each of 8 weight rows; 4 activation codes broadcast to
// every lane multiply with it, so the int32 lanes are the 8 rows' dot products and one vector
// of 8 scales turns them into floats: per block, one conversion and one multiply-add serve 8
// rows (the row-major kernels pay that per row). AVX2 multiplies with maddubs + madd (pairs
// summed in int16 where the bound allows), VNNI with vpdpbusd; signed codes (Q8_0, IQ4) take
// +128 under VNNI (the activation sums take it back out) and the sign trick under AVX2.
//
// The portable build reads the same layout one row at a time (unpack_x8, then the row-major
// kernel).

#if defined(__AVX2__)

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVQ_VNNI 1
#else
#define KVQ_VNNI 0
#endif

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The block PF_BYTES ahead of `blk` (the next blocks of this group, then the next group's: a
// group's blocks and the groups lie back to back) on its way to L2: decode steps stream the
// weights from memory once, and with the compute between loads the core alone does not keep
// enough misses in flight. Into L2, not L1 (T0): L1's few miss buffers capped a core at ~12
// GB/s, L2's deeper queue does not. Measured on the 2-core EPYC (Zen 4), 1-row products of
// 4096-wide Q4_0 / Q4_K / Q6_K weights, 2 threads: T0 at 4 KiB 19-24 / 19-24 / 19 GB/s,
// T2 at 16 KiB 27-30 / 28-33 / 25-26 GB/s (12-32 KiB within noise of it; torch's own f32
// sum reads 32 GB/s there). KVQ_PF_BYTES / KVQ_PF_HINT override them at build time.
#ifndef KVQ_PF_BYTES
#define KVQ_PF_BYTES 16384
#endif
constexpr int PF_BYTES = KVQ_PF_BYTES;
#ifndef KVQ_PF_HINT
#define KVQ_PF_HINT _MM_HINT_T2
#endif
template <int BYTES>
inline void prefetch_next(const uint8_t* blk) {
  constexpr int AHEAD = BYTES >= PF_BYTES ? BYTES : (PF_BYTES / BYTES) * BYTES;
  for (int o = 0; o < BYTES; o += 64) _mm_prefetch((const char*)(blk + AHEAD + o), KVQ_PF_HINT);
}

// acc += 4-byte dot products of unsigned codes with signed activations, per int32 lane
inline __m256i dpu(__m256i acc, __m256i q, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, q, y);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, q, y);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), _mm256_set1_epi16(1)));
#endif
}

// int16 pairs of (x, x) per int32 lane from 8 bytes (one per lane): madd's scale operand
inline __m256i pair16_u8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
inline __m256i pair16_i8(const uint8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
inline __m256i lanes_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
inline __m256i lanes_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
// int16 pairs (a[r], b[r]) per lane r from two rows of 8 bytes (sub-block scales of 8 rows)
inline __m256i zip16_u8(const uint8_t* a, const uint8_t* b) {
  const __m128i z = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b));
  return _mm256_cvtepu8_epi16(z);
}
inline __m256i zip16_i8(const uint8_t* a, const uint8_t* b) {
  const __m128i z = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)a), _mm_loadl_epi64((const __m128i*)b));
  return _mm256_cvtepi8_epi16(z);
}
inline __m256i two16(int lo, int hi) {
  return _mm256_set1_epi32((int)(((uint32_t)(uint16_t)hi << 16) | (uint16_t)lo));
}
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

inline __m256i iq4_table() {
#if KVQ_VNNI
  // the levels + 128, unsigned: vpdpbusd takes them as they are
  const __m128i t = _mm_add_epi8(_mm_loadu_si128((const __m128i*)kIQ4Levels), _mm_set1_epi8((char)0x80));
#else
  const __m128i t = _mm_loadu_si128((const __m128i*)kIQ4Levels);
#endif
  return _mm256_set_m128i(t, t);
}

// acc += codes . y for codes as iq4_table() gives them (signed levels under AVX2)
inline __m256i dp_levels(__m256i acc, __m256i q, __m256i y) {
#if KVQ_VNNI
  return dpu(acc, q, y);
#else
  return dpu(acc, _mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
#endif
}

// Q5_0 / Q5_1: the fifth bits of 4 codes of each row (bits shift..shift + 3 of the row's 32-bit
// qh, one row a lane) as 0x10 in their bytes
inline __m256i fifth_x8(__m256i qh, int shift) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
                                          0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
  const __m256i bits = _mm256_set1_epi32(0x08040201);
  __m256i t = _mm256_shuffle_epi8(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(shift)), spread);
  t = _mm256_cmpeq_epi8(_mm256_and_si256(t, bits), bits);
  return _mm256_and_si256(t, _mm256_set1_epi8(0x10));
}

// ---- 32-element blocks: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0
template <int T, int MT>
inline void x8_row32(const uint8_t* g, int64_t nb, const Act& a, int64_t i0, __m256 acc[MT]) {
  constexpr int BYTES = x8_bytes(T);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lv = iq4_table();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * BYTES;
    prefetch_next<BYTES>(blk);
    const __m256 d = f16x8(blk);
    constexpr int QS = T == Q4_1 ? 32 : T == Q5_0 ? 48 : T == Q5_1 ? 64 : 16;
    const uint8_t* qs = blk + QS;
    __m256i qh = _mm256_setzero_si256();
    if constexpr (T == Q5_0 || T == Q5_1)
      qh = _mm256_loadu_si256((const __m256i*)(blk + (T == Q5_0 ? 16 : 32)));
    const int8_t* y[MT];
    __m256i isum[MT], isum2[MT];  // two chains of vpdpbusd (its latency, not its rate, binds)
    for (int t = 0; t < MT; t++) {
      y[t] = a.q32 + ((i0 + t) * nb + b) * 32;
      isum[t] = isum2[t] = _mm256_setzero_si256();
    }
    if constexpr (T == Q8_0) {
#pragma GCC unroll 8
      for (int e = 0; e < 8; e++) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * e));
#if KVQ_VNNI
        const __m256i wu = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        for (int t = 0; t < MT; t++) {
          if (e % 2) isum2[t] = dpu(isum2[t], wu, bcast4(y[t] + 4 * e));
          else isum[t] = dpu(isum[t], wu, bcast4(y[t] + 4 * e));
        }
#else
        const __m256i wa = _mm256_sign_epi8(w, w);
        for (int t = 0; t < MT; t++) isum[t] = dpu(isum[t], wa, _mm256_sign_epi8(bcast4(y[t] + 4 * e), w));
#endif
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(raw, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if constexpr (T == Q5_0 || T == Q5_1) {  // elements 4j.. and 16 + 4j..: their bits
          lo = _mm256_or_si256(lo, fifth_x8(qh, 4 * j));
          hi = _mm256_or_si256(hi, fifth_x8(qh, 16 + 4 * j));
        }
        if constexpr (T == IQ4_NL) {
          lo = _mm256_shuffle_epi8(lv, lo);
          hi = _mm256_shuffle_epi8(lv, hi);
          for (int t = 0; t < MT; t++) {
            isum[t] = dp_levels(isum[t], lo, bcast4(y[t] + 4 * j));
            isum2[t] = dp_levels(isum2[t], hi, bcast4(y[t] + 16 + 4 * j));
          }
        } else {
          for (int t = 0; t < MT; t++) {
#if KVQ_VNNI
            isum[t] = dpu(isum[t], lo, bcast4(y[t] + 4 * j));
            isum2[t] = dpu(isum2[t], hi, bcast4(y[t] + 16 + 4 * j));
#else  // both products summed in int16 (|pair| <= 2 * 31 * 127, two of them fit)
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(y[t] + 4 * j)),
                                               _mm256_maddubs_epi16(hi, bcast4(y[t] + 16 + 4 * j)));
            isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
          }
        }
      }
    }
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      isum[t] = _mm256_add_epi32(isum[t], isum2[t]);
      if (KVQ_VNNI && (T == Q8_0 || T == IQ4_NL))
        isum[t] = _mm256_sub_epi32(isum[t], _mm256_set1_epi32(128 * a.sum32[ab]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.d32[ab])), acc[t]);
      if constexpr (T == Q4_0) acc[t] = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * a.ds32[ab]), acc[t]);
      if constexpr (T == Q5_0) acc[t] = _mm256_fmadd_ps(d, _mm256_set1_ps(-16.f * a.ds32[ab]), acc[t]);
      if constexpr (T == Q4_1 || T == Q5_1)
        acc[t] = _mm256_fmadd_ps(f16x8(blk + 16), _mm256_set1_ps(a.s32[ab]), acc[t]);
    }
  }
}

// ---- Q4_K / Q5_K: per chunk c, sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
template <bool FIVE, int MT>
inline void x8_rowk45(const uint8_t* g, int64_t nb, const Act& a, int64_t i0, __m256 acc[MT]) {
  constexpr int BYTES = FIVE ? 1440 : 1184;
  const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * BYTES;
    prefetch_next<BYTES>(blk);
    const uint8_t* sc = blk + 32;
    const uint8_t* mn = blk + 96;
    const uint8_t* qh = blk + 160;
    const uint8_t* qs = blk + (FIVE ? 416 : 160);
    const int8_t* y[MT];
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) {
      y[t] = a.qK + ((i0 + t) * nb + b) * 256;
      isum[t] = _mm256_setzero_si256();
    }
    for (int c = 0; c < 4; c++) {
      __m256i slo[MT], shi[MT];
      for (int t = 0; t < MT; t++) slo[t] = shi[t] = _mm256_setzero_si256();
#if !KVQ_VNNI
      const __m256i sclo = pair16_u8(sc + 8 * (2 * c)), schi = pair16_u8(sc + 8 * (2 * c + 1));
#endif
      // Q4_K: int16 pair sums stay below 2 * 15 * 127 * 8 over 8 runs; Q5_K's (31) over 4
      constexpr int RUNS16 = FIVE ? 4 : 8;
      for (int e0 = 0; e0 < 8; e0 += RUNS16) {
        __m256i plo[MT], phi[MT];
        for (int t = 0; t < MT; t++) plo[t] = phi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int e = e0; e < e0 + RUNS16; e++) {
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 256 * c + 32 * e));
          __m256i lo = _mm256_and_si256(raw, m4);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          if constexpr (FIVE) {  // fifth bits: bit 2c (low) and 2c + 1 (high) of qh, to bit 4
            const __m256i h = _mm256_loadu_si256((const __m256i*)(qh + 32 * e));
            const int j0 = 2 * c, j1 = 2 * c + 1;
            const __m256i h0 = j0 <= 4 ? _mm256_slli_epi16(h, 4 - j0) : _mm256_srli_epi16(h, j0 - 4);
            const __m256i h1 = j1 <= 4 ? _mm256_slli_epi16(h, 4 - j1) : _mm256_srli_epi16(h, j1 - 4);
            lo = _mm256_or_si256(lo, _mm256_and_si256(h0, b4));
            hi = _mm256_or_si256(hi, _mm256_and_si256(h1, b4));
          }
          for (int t = 0; t < MT; t++) {
            const __m256i ylo = bcast4(y[t] + 64 * c + 4 * e);
            const __m256i yhi = bcast4(y[t] + 64 * c + 32 + 4 * e);
#if KVQ_VNNI
            slo[t] = dpu(slo[t], lo, ylo);
            shi[t] = dpu(shi[t], hi, yhi);
#else
            plo[t] = _mm256_add_epi16(plo[t], _mm256_maddubs_epi16(lo, ylo));
            phi[t] = _mm256_add_epi16(phi[t], _mm256_maddubs_epi16(hi, yhi));
#endif
          }
        }
#if !KVQ_VNNI
        for (int t = 0; t < MT; t++) {
          slo[t] = _mm256_add_epi32(slo[t], _mm256_madd_epi16(plo[t], sclo));
          shi[t] = _mm256_add_epi32(shi[t], _mm256_madd_epi16(phi[t], schi));
        }
#endif
      }
      for (int t = 0; t < MT; t++) {
#if KVQ_VNNI
        slo[t] = _mm256_mullo_epi32(slo[t], lanes_u8(sc + 8 * (2 * c)));
        shi[t] = _mm256_mullo_epi32(shi[t], lanes_u8(sc + 8 * (2 * c + 1)));
#endif
        isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(slo[t], shi[t]));
      }
    }
    const __m256 d = f16x8(blk), dmin = f16x8(blk + 16);
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      const int16_t* bs = a.bsK + ab * 16;
      __m256i msum = _mm256_setzero_si256();
      for (int j = 0; j < 8; j += 2) {
        const __m256i m = zip16_u8(mn + 8 * j, mn + 8 * (j + 1));
        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(m, two16(bs[2 * j] + bs[2 * j + 1], bs[2 * j + 2] + bs[2 * j + 3])));
      }
      const __m256 da = _mm256_set1_ps(a.dK[ab]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, da), acc[t]);
      acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, da), acc[t]);
    }
  }
}

// ---- Q6_K: per half h and run e, one load of each ql part and of qh gives the codes of all
// four groups i (32 elements each, scales s = 8h + 2i for runs 0..3, + 1 for runs 4..7)
template <int MT>
inline void x8_rowq6k(const uint8_t* g, int64_t nb, const Act& a, int64_t i0, __m256 acc[MT]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * 1680;
    prefetch_next<1680>(blk);
    const uint8_t* sc = blk + 16;
    const int8_t* y[MT];
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) {
      y[t] = a.qK + ((i0 + t) * nb + b) * 256;
      isum[t] = _mm256_setzero_si256();
    }
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql0 = blk + 144 + 256 * (2 * h);
      const uint8_t* ql1 = ql0 + 256;
      const uint8_t* qh = blk + 1168 + 256 * h;
      for (int half = 0; half < 2; half++) {
        // VNNI builds have 32 vector registers: all four groups per pass; AVX2's 16 hold two
        constexpr int GP = KVQ_VNNI ? 4 : 2;
        for (int i0g = 0; i0g < 4; i0g += GP) {
          __m256i part[GP][MT];
          for (int i = 0; i < GP; i++)
            for (int t = 0; t < MT; t++) part[i][t] = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int e = 4 * half; e < 4 * half + 4; e++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql0 + 32 * e));
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql1 + 32 * e));
            const __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * e));
            __m256i q[GP];
            for (int i = 0; i < GP; i++) {
              const int gi = i0g + i;  // low nibbles for groups 0, 1; high for 2, 3
              const __m256i l = gi % 2 ? l1 : l0;
              const __m256i lo = _mm256_and_si256(gi < 2 ? l : _mm256_srli_epi16(l, 4), m4);
              const __m256i hi2 = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * gi), m2);
              q[i] = _mm256_or_si256(lo, _mm256_slli_epi16(hi2, 4));
            }
            for (int i = 0; i < GP; i++)
              for (int t = 0; t < MT; t++) {
                const __m256i yv = bcast4(y[t] + 128 * h + 32 * (i0g + i) + 4 * e);
#if KVQ_VNNI
                part[i][t] = dpu(part[i][t], q[i], yv);
#else  // |pair| <= 2 * 63 * 127
                part[i][t] = _mm256_add_epi32(part[i][t], _mm256_madd_epi16(_mm256_maddubs_epi16(q[i], yv), _mm256_set1_epi16(1)));
#endif
              }
          }
          for (int i = 0; i < GP; i++) {
            const __m256i sv = lanes_i8(sc + 8 * (8 * h + 2 * (i0g + i) + half));
            for (int t = 0; t < MT; t++) isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(part[i][t], sv));
          }
        }
      }
    }
    const __m256 d = f16x8(blk);
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      const int16_t* bs = a.bsK + ab * 16;
      __m256i off = _mm256_setzero_si256();  // sum over s of scale x activation sum: the -32
      for (int s = 0; s < 16; s += 2)
        off = _mm256_add_epi32(off, _mm256_madd_epi16(zip16_i8(sc + 8 * s, sc + 8 * (s + 1)), two16(bs[s], bs[s + 1])));
      const __m256i tot = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(off, 5));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d, _mm256_set1_ps(a.dK[ab])), acc[t]);
    }
  }
}

// ---- IQ4_XS: sub-block j, runs e (0..3): low nibbles elements 4e.., high 16 + 4e..
template <int MT>
inline void x8_rowiq4xs(const uint8_t* g, int64_t nb, const Act& a, int64_t i0, __m256 acc[MT]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i lv = iq4_table();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = g + b * 1104;
    prefetch_next<1104>(blk);
    const uint8_t* ls = blk + 16;
    const int8_t* y[MT];
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) {
      y[t] = a.qK + ((i0 + t) * nb + b) * 256;
      isum[t] = _mm256_setzero_si256();
    }
    for (int j = 0; j < 8; j++) {
      __m256i part[MT];
      for (int t = 0; t < MT; t++) part[t] = _mm256_setzero_si256();
#if !KVQ_VNNI
      const __m256i sv = pair16_i8(ls + 8 * j);
#endif
#pragma GCC unroll 4
      for (int e = 0; e < 4; e++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 80 + 128 * j + 32 * e));
        const __m256i lo = _mm256_shuffle_epi8(lv, _mm256_and_si256(raw, m4));
        const __m256i hi = _mm256_shuffle_epi8(lv, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
        for (int t = 0; t < MT; t++) {
          const __m256i ya = bcast4(y[t] + 32 * j + 4 * e), yb = bcast4(y[t] + 32 * j + 16 + 4 * e);
#if KVQ_VNNI
          part[t] = dpu(dpu(part[t], lo, ya), hi, yb);
#else  // |pair| <= 2 * 127 * 127: scaled one run at a time
          const __m256i pa = _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(ya, lo));
          const __m256i pb = _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(yb, hi));
          part[t] = _mm256_add_epi32(part[t], _mm256_add_epi32(_mm256_madd_epi16(pa, sv), _mm256_madd_epi16(pb, sv)));
#endif
        }
      }
      for (int t = 0; t < MT; t++) {
#if KVQ_VNNI
        const int64_t ab = (i0 + t) * nb + b;
        const int ysum = a.bsK[ab * 16 + 2 * j] + a.bsK[ab * 16 + 2 * j + 1];
        part[t] = _mm256_sub_epi32(part[t], _mm256_set1_epi32(128 * ysum));
        part[t] = _mm256_mullo_epi32(part[t], lanes_i8(ls + 8 * j));
#endif
        isum[t] = _mm256_add_epi32(isum[t], part[t]);
      }
    }
    const __m256 d = f16x8(blk);
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_mul_ps(d, _mm256_set1_ps(a.dK[ab])), acc[t]);
    }
  }
}

template <int T, int MT>
inline void x8_group(const uint8_t* g, int64_t nb, const Act& a, int64_t i0, float* y, int64_t ldy,
                     int valid) {
  __m256 acc[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
  if constexpr (T == Q4_K) x8_rowk45<false, MT>(g, nb, a, i0, acc);
  else if constexpr (T == Q5_K) x8_rowk45<true, MT>(g, nb, a, i0, acc);
  else if constexpr (T == Q6_K) x8_rowq6k<MT>(g, nb, a, i0, acc);
  else if constexpr (T == IQ4_XS) x8_rowiq4xs<MT>(g, nb, a, i0, acc);
  else x8_row32<T, MT>(g, nb, a, i0, acc);
  for (int t = 0; t < MT; t++) {
    float* out = y + (i0 + t) * ldy;
    if (valid == X8) {
      _mm256_storeu_ps(out, acc[t]);
    } else {
      alignas(32) float tmp[X8];
      _mm256_store_ps(tmp, acc[t]);
      for (int r = 0; r < valid; r++) out[r] = tmp[r];
    }
  }
}

// groups of 8 weight rows (n rows in all) against m activation rows, MT_MAX at a time
template <int T>
void gemm_x8(const uint8_t* w, int64_t group_bytes, int64_t n, const Act& a, int64_t m, float* y,
             int64_t ldy) {
  const int64_t nb = group_bytes / x8_bytes(T);
  for (int64_t i0 = 0; i0 < m; i0 += MT_MAX) {
    const int64_t mt = m - i0 < MT_MAX ? m - i0 : MT_MAX;
    for (int64_t r0 = 0; r0 < n; r0 += X8) {
      const uint8_t* g = w + (r0 / X8) * group_bytes;
      const int valid = n - r0 < X8 ? (int)(n - r0) : X8;
      switch (mt) {
        case 1: x8_group<T, 1>(g, nb, a, i0, y + r0, ldy, valid); break;
        case 2: x8_group<T, 2>(g, nb, a, i0, y + r0, ldy, valid); break;
        case 3: x8_group<T, 3>(g, nb, a, i0, y + r0, ldy, valid); break;
        default: x8_group<T, 4>(g, nb, a, i0, y + r0, ldy, valid); break;
      }
    }
  }
}

#else  // portable: each row of a group unpacked to GGUF blocks, then the row-major kernel

template <int T>
void gemm_x8(const uint8_t* w, int64_t group_bytes, int64_t n, const Act& a, int64_t m, float* y,
             int64_t ldy) {
  const TypeInfo ti = type_info(T);
  const int64_t nb = group_bytes / x8_bytes(T);
  uint8_t row[256 * 210];  // one row of up to 256 blocks; longer rows go a slice at a time
  for (int64_t r = 0; r < n; r++) {
    const uint8_t* g = w + (r / X8) * group_bytes;
    for (int64_t i = 0; i < m; i++) y[i * ldy + r] = 0.f;
    for (int64_t b0 = 0; b0 < nb; b0 += 256) {
      const int64_t cnt = nb - b0 < 256 ? nb - b0 : 256;
      for (int64_t b = 0; b < cnt; b++)
        unpack_x8(T, row + b * ti.bytes, g + (b0 + b) * x8_bytes(T), (int)(r % X8));
      Act part = a;  // the activations of this slice of blocks
      part.k = cnt * ti.block;
      for (int64_t i = 0; i < m; i++) {
        Act one = part;
        const int64_t off = i * a.k + b0 * ti.block;
        if (a.q32) {
          one.q32 = a.q32 + off;
          one.d32 = a.d32 + off / 32;
          one.sum32 = a.sum32 + off / 32;
          one.ds32 = a.ds32 + off / 32;
          one.s32 = a.s32 + off / 32;
        }
        if (a.qK) {
          one.qK = a.qK + off;
          one.dK = a.dK + off / 256;
          one.bsK = a.bsK + off / 16;
        }
        float out = 0.f;
        if constexpr (type_info(T).block == 32)
          gemm32_portable<T, type_info(T).bytes>(row, 0, 1, one, 1, &out, 1);
        else
          gemmK_portable<T, type_info(T).bytes>(row, 0, 1, one, 1, &out, 1);
        y[i * ldy + r] += out;
      }
    }
  }
}

#endif
