// Quantized products and dequantization for GGUF's block types, read as the file stores them.
//
// This file is compiled once per instruction set (kvrun/quant/native.py): without flags (the
// portable path), with -mavx2 -mfma -mf16c, and with AVX-512 VNNI or AVX-VNNI on top; each build
// exports one table (KVQ_TABLE names it) and the torch side picks one at run time. No torch
// here: plain pointers in, plain floats out.
//
// Products follow llama.cpp's arithmetic (ggml-cpu's quants.c is the reference we match, not a
// source we copy): activations are quantized to 8 bits per block (q8_0 / q8_1 for 32-element
// types, q8_K for the 256-element K and IQ4_XS types, the same rounding), each block's integer
// dot product is exact, and the block scales multiply it in float32. Unsigned weight codes go
// straight into `maddubs` / `vpdpbusd`; their offset (Q4_0's 8, Q5_0's 16, Q6_K's 32) and the
// minimums (Q4_1, Q5_1, Q4_K, Q5_K) are applied through the activation blocks' sums. A weight
// block is decoded once and multiplied with up to 4 activation rows (the row tile), so a small
// batch reads each weight once.
//
// Dequantization gives exactly the float32 values gguf.quants.dequantize gives (the same
// products in the same order; built with -ffp-contract=off so no multiply-add is fused).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "qlayout.h"
#include "qtypes.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef KVQ_TABLE
#define KVQ_TABLE kvq_table_generic
#endif

namespace {

using namespace kvq;

constexpr int MT_MAX = 4;  // activation rows per pass over a weight row

inline float f16(const uint8_t* p) {
#if defined(__F16C__)
  return _cvtsh_ss(load_u16(p));
#else
  return fp16_to_fp32(load_u16(p));
#endif
}

inline float round_f16(float x) {
#if defined(__F16C__)
  return _cvtsh_ss(_cvtss_sh(x, 0));
#else
  return fp16_to_fp32(fp32_to_fp16(x));
#endif
}

// ------------------------------------------------------------------ activation quantization
// q8_0 / q8_1 as llama.cpp's x86 path makes them: d = amax / 127 (kept as fp16), codes
// round-half-even(x * 127 / amax); q8_1 adds fp16(d * sum of codes).
void quant32(const float* x, int64_t k, int8_t* q, float* d, int32_t* sum, float* ds, float* s) {
  for (int64_t b = 0; b < k / 32; b++) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(xb[j]));
    const float dd = amax / 127.f;
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t acc = 0;
    for (int j = 0; j < 32; j++) {
      const int v = (int)std::nearbyint(xb[j] * id);
      q[b * 32 + j] = (int8_t)v;
      acc += v;
    }
    d[b] = round_f16(dd);
    sum[b] = acc;
    ds[b] = d[b] * (float)acc;
    s[b] = round_f16(dd * (float)acc);
  }
}

// q8_K as llama.cpp makes it: the signed value of largest magnitude maps to -127, codes
// round-half-even, d = 1 / iscale kept in float32, and the sums of each 16 codes.
void quantK(const float* x, int64_t k, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < k / 256; b++) {
    const float* xb = x + b * 256;
    int8_t* qb = q + b * 256;
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 256; j++) {
      const float ax = std::fabs(xb[j]);
      if (ax > amax) {
        amax = ax;
        mx = xb[j];
      }
    }
    if (amax == 0.f) {
      d[b] = 0.f;
      std::memset(qb, 0, 256);
      std::memset(bs + b * 16, 0, 16 * sizeof(int16_t));
      continue;
    }
    const float iscale = -127.f / mx;
    for (int j = 0; j < 256; j++) {
      const int v = (int)std::nearbyint(iscale * xb[j]);
      qb[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; j++) {
      int acc = 0;
      for (int i = 0; i < 16; i++) acc += qb[j * 16 + i];
      bs[b * 16 + j] = (int16_t)acc;
    }
    d[b] = 1.f / iscale;
  }
}

// ------------------------------------------------------------------------ dequantization
void dq_q4_0(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 18, out += 32) {
    const float d = f16(w);
    for (int j = 0; j < 16; j++) {
      out[j] = d * (float)((w[2 + j] & 15) - 8);
      out[j + 16] = d * (float)((w[2 + j] >> 4) - 8);
    }
  }
}

void dq_q4_1(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 20, out += 32) {
    const float d = f16(w), m = f16(w + 2);
    for (int j = 0; j < 16; j++) {
      out[j] = d * (float)(w[4 + j] & 15) + m;
      out[j + 16] = d * (float)(w[4 + j] >> 4) + m;
    }
  }
}

void dq_q5_0(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 22, out += 32) {
    const float d = f16(w);
    const uint32_t qh = load_u32(w + 2);
    for (int j = 0; j < 16; j++) {
      const int lo = (w[6 + j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (w[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      out[j] = d * (float)(lo - 16);
      out[j + 16] = d * (float)(hi - 16);
    }
  }
}

void dq_q5_1(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 24, out += 32) {
    const float d = f16(w), m = f16(w + 2);
    const uint32_t qh = load_u32(w + 4);
    for (int j = 0; j < 16; j++) {
      const int lo = (w[8 + j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (w[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      out[j] = d * (float)lo + m;
      out[j + 16] = d * (float)hi + m;
    }
  }
}

void dq_q8_0(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 34, out += 32) {
    const float d = f16(w);
    for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)w[2 + j] * d;
  }
}

void dq_iq4_nl(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; b++, w += 18, out += 32) {
    const float d = f16(w);
    for (int j = 0; j < 16; j++) {
      out[j] = d * (float)kIQ4Levels[w[2 + j] & 15];
      out[j + 16] = d * (float)kIQ4Levels[w[2 + j] >> 4];
    }
  }
}

// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin; element
// 128 g + 32 s + l holds bits 2s..2s+1 of qs[32 g + l], with the scale of its 16
void dq_q2_k(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 256; b++, w += 84, out += 256) {
    const float d = f16(w + 80), dmin = f16(w + 82);
    for (int e = 0; e < 256; e++) {
      const int g = e / 128, s = (e % 128) / 32, l = e % 32;
      const uint8_t sc = w[e / 16];
      const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
      const int q = (w[16 + 32 * g + l] >> (2 * s)) & 3;
      out[e] = dl * (float)q - ml;
    }
  }
}

// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d; element 128 g + 32 s + l is
// bits 2s..2s+1 of qs[32 g + l], minus 4 unless bit (e / 32) of hmask[l] is set
void dq_q3_k(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 256; b++, w += 110, out += 256) {
    const float d = f16(w + 108);
    const uint8_t* sc = w + 96;
    float dl[16];
    for (int j = 0; j < 16; j++) {
      const int lo = (j < 8 ? sc[j] : sc[j - 8] >> 4) & 0xF;
      const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
      dl[j] = d * (float)((lo | (hi << 4)) - 32);
    }
    for (int e = 0; e < 256; e++) {
      const int g = e / 128, s = (e % 128) / 32, l = e % 32;
      const int ql = (w[32 + 32 * g + l] >> (2 * s)) & 3;
      const int hbit = (w[l] >> (e / 32)) & 1;
      out[e] = dl[e / 16] * (float)(ql - (hbit ? 0 : 4));
    }
  }
}

// Q4_K / Q5_K: d, dmin, scales[12] (eight 6-bit scales and mins), [qh[32],] qs[128]; element
// 64 c + l (l < 32) is the low nibble of qs[32 c + l], element 64 c + 32 + l its high nibble;
// Q5_K's fifth bit of sub-block j is bit j of qh[l]
template <bool FIVE>
void dq_qk45(const uint8_t* w, int64_t k, float* out) {
  constexpr int BYTES = FIVE ? 176 : 144;
  for (int64_t b = 0; b < k / 256; b++, w += BYTES, out += 256) {
    const float d = f16(w), dmin = f16(w + 2);
    const uint8_t* qh = w + 16;
    const uint8_t* qs = w + (FIVE ? 48 : 16);
    for (int j = 0; j < 8; j++) {
      int sc, mn;
      k_scale_min(w + 4, j, sc, mn);
      const float dl = d * (float)sc, ml = dmin * (float)mn;
      for (int l = 0; l < 32; l++) {
        int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if (FIVE) q |= ((qh[l] >> j) & 1) << 4;
        out[32 * j + l] = dl * (float)q - ml;
      }
    }
  }
}

// Q6_K: ql[128], qh[64], scales[16] (int8, one per 16), d; in half h, element 32 i + l (i < 4)
// is the low (i even) or high (i odd) nibble of ql[64 h + 32 (i % 2) + l] with bits 2i..2i+1
// of qh[32 h + l] on top, minus 32
inline int q6_code(const uint8_t* w, int e) {
  const int h = e / 128, i = (e % 128) / 32, l = e % 32;
  const int lo = (w[64 * h + 32 * (i % 2) + l] >> (4 * (i / 2))) & 15;
  const int hi = (w[128 + 32 * h + l] >> (2 * i)) & 3;
  return (lo | (hi << 4)) - 32;
}

void dq_q6_k(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 256; b++, w += 210, out += 256) {
    const float d = f16(w + 208);
    for (int e = 0; e < 256; e++) {
      const float dl = d * (float)(int8_t)w[192 + e / 16];
      out[e] = dl * (float)q6_code(w, e);
    }
  }
}

// IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; sub-block j (32 elements) has the 6-bit
// scale (scales_l nibble j | 2 bits of scales_h) - 32 and the levels of qs[16 j ..] (low
// nibbles first)
inline int iq4xs_scale(const uint8_t* w, int j) {
  const int lo = (w[4 + j / 2] >> (4 * (j % 2))) & 0xF;
  const int hi = (load_u16(w + 2) >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

void dq_iq4_xs(const uint8_t* w, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 256; b++, w += 136, out += 256) {
    const float d = f16(w);
    for (int j = 0; j < 8; j++) {
      const float dl = d * (float)iq4xs_scale(w, j);
      const uint8_t* qs = w + 8 + 16 * j;
      for (int l = 0; l < 16; l++) {
        out[32 * j + l] = dl * (float)kIQ4Levels[qs[l] & 15];
        out[32 * j + 16 + l] = dl * (float)kIQ4Levels[qs[l] >> 4];
      }
    }
  }
}

// ------------------------------------------------------------------- products: portable
// Each type as integer codes per block: the portable path does the same integer dot products
// and the same float products of block scales as the vector paths (the order of the float
// sums differs).

// 32-element types: codes (with Q4_0's / Q5_0's offset kept: unsigned), scale, minimum
struct Block32 {
  int q[32];
  float d, m;
};

template <int T>
inline void decode32(const uint8_t* w, Block32& b) {
  b.m = 0.f;
  if (T == Q4_0 || T == IQ4_NL) {
    b.d = f16(w);
    for (int j = 0; j < 16; j++) {
      b.q[j] = w[2 + j] & 15;
      b.q[j + 16] = w[2 + j] >> 4;
    }
    if (T == IQ4_NL)
      for (int j = 0; j < 32; j++) b.q[j] = kIQ4Levels[b.q[j]];
  } else if (T == Q4_1) {
    b.d = f16(w);
    b.m = f16(w + 2);
    for (int j = 0; j < 16; j++) {
      b.q[j] = w[4 + j] & 15;
      b.q[j + 16] = w[4 + j] >> 4;
    }
  } else if (T == Q5_0 || T == Q5_1) {
    const int off = T == Q5_0 ? 2 : 4;
    b.d = f16(w);
    if (T == Q5_1) b.m = f16(w + 2);
    const uint32_t qh = load_u32(w + off);
    for (int j = 0; j < 16; j++) {
      b.q[j] = (w[off + 4 + j] & 15) | (((qh >> j) & 1) << 4);
      b.q[j + 16] = (w[off + 4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  } else {  // Q8_0
    b.d = f16(w);
    for (int j = 0; j < 32; j++) b.q[j] = (int8_t)w[2 + j];
  }
}

// the float terms beside d * da * dot for one block: offsets and minimums
template <int T>
inline float bias32(const Block32& b, const Act& a, int64_t ab) {
  if (T == Q4_0) return -8.f * b.d * a.ds32[ab];
  if (T == Q5_0) return -16.f * b.d * a.ds32[ab];
  if (T == Q4_1 || T == Q5_1) return b.m * a.s32[ab];
  return 0.f;
}

template <int T, int BYTES>
void gemm32_portable(const uint8_t* w, int64_t row_bytes, int64_t n, const Act& a, int64_t m,
                     float* y, int64_t ldy) {
  const int64_t nb = a.k / 32;
  Block32 blk;
  for (int64_t r = 0; r < n; r++) {
    const uint8_t* wr = w + r * row_bytes;
    for (int64_t i = 0; i < m; i++) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; b++) {
        decode32<T>(wr + b * BYTES, blk);
        const int64_t ab = i * nb + b;
        const int8_t* yq = a.q32 + ab * 32;
        int32_t dot = 0;
        for (int j = 0; j < 32; j++) dot += blk.q[j] * yq[j];
        acc += (float)dot * (blk.d * a.d32[ab]) + bias32<T>(blk, a, ab);
      }
      y[i * ldy + r] = acc;
    }
  }
}

// 256-element types: integer sum over the super-block of scale x sub-block dot, and the
// float result for one activation row
template <int T>
float superblock_portable(const uint8_t* w, const int8_t* yq, float da, const int16_t* bs) {
  if (T == Q4_K || T == Q5_K) {
    const uint8_t* qh = w + 16;
    const uint8_t* qs = w + (T == Q5_K ? 48 : 16);
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
      int sc, mn;
      k_scale_min(w + 4, j, sc, mn);
      int32_t dot = 0;
      for (int l = 0; l < 32; l++) {
        int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
        if (T == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        dot += q * yq[32 * j + l];
      }
      isum += sc * dot;
      msum += mn * (bs[2 * j] + bs[2 * j + 1]);
    }
    return da * f16(w) * (float)isum - da * f16(w + 2) * (float)msum;
  }
  if (T == Q6_K) {
    int32_t isum = 0;
    for (int s = 0; s < 16; s++) {
      int32_t dot = 0;
      for (int l = 0; l < 16; l++) dot += q6_code(w, 16 * s + l) * yq[16 * s + l];
      isum += (int8_t)w[192 + s] * dot;
    }
    return da * f16(w + 208) * (float)isum;
  }
  // IQ4_XS
  int32_t isum = 0;
  for (int j = 0; j < 8; j++) {
    const uint8_t* qs = w + 8 + 16 * j;
    int32_t dot = 0;
    for (int l = 0; l < 16; l++) {
      dot += kIQ4Levels[qs[l] & 15] * yq[32 * j + l];
      dot += kIQ4Levels[qs[l] >> 4] * yq[32 * j + 16 + l];
    }
    isum += iq4xs_scale(w, j) * dot;
  }
  return da * f16(w) * (float)isum;
}

template <int T, int BYTES>
void gemmK_portable(const uint8_t* w, int64_t row_bytes, int64_t n, const Act& a, int64_t m,
                    float* y, int64_t ldy) {
  const int64_t nb = a.k / 256;
  for (int64_t r = 0; r < n; r++) {
    const uint8_t* wr = w + r * row_bytes;
    for (int64_t i = 0; i < m; i++) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; b++) {
        const int64_t ab = i * nb + b;
        acc += superblock_portable<T>(wr + b * BYTES, a.qK + ab * 256, a.dK[ab], a.bsK + ab * 16);
      }
      y[i * ldy + r] = acc;
    }
  }
}

#if defined(__AVX2__)
// ----------------------------------------------------------------------- products: AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// unsigned codes (0..63) x signed activations -> 8 int32 partial sums
inline __m256i dot_us(__m256i q, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, y);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), _mm256_set1_epi16(1));
#endif
}

// signed codes x signed activations (|q| <= 128, y > -128): the sign moves onto y
inline __m256i dot_ss(__m256i q, __m256i y) {
  return dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
}

// the 16 bytes of a 32-element block's nibbles -> 32 codes, low nibbles first
inline __m256i nibbles(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128((const __m128i*)p);
  const __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0x10 where the bit is set (the fifth bit of Q5_0 / Q5_1 codes)
inline __m256i fifth_bits(uint32_t x) {
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                          0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

inline __m256i iq4_levels() {
  const __m128i t = _mm_loadu_si128((const __m128i*)kIQ4Levels);
  return _mm256_set_m128i(t, t);
}

// One 32-element block of type T: its bytes, its 32 codes as bytes (Q5's fifth bits and
// IQ4_NL's levels applied) and the dot product they take: unsigned codes for the offset
// types (the offset comes back through the activation sums), signed for Q8_0 and IQ4_NL.
template <int T>
struct Dec32 {
  static constexpr int QS = T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2;  // codes start
  static constexpr int BYTES = T == Q8_0 ? 34 : QS + 16;
  static __m256i codes(const uint8_t* w) {
    if constexpr (T == Q8_0) return _mm256_loadu_si256((const __m256i*)(w + QS));
    else if constexpr (T == IQ4_NL) return _mm256_shuffle_epi8(iq4_levels(), nibbles(w + QS));
    else if constexpr (T == Q5_0 || T == Q5_1)  // the 32 fifth bits just before the codes
      return _mm256_or_si256(nibbles(w + QS), fifth_bits(load_u32(w + QS - 4)));
    else return nibbles(w + QS);
  }
  static __m256i dot(__m256i q, __m256i y) {
    if constexpr (T == Q8_0 || T == IQ4_NL) return dot_ss(q, y);
    else return dot_us(q, y);
  }
};

// one weight row against MT activation rows (i0 ..), blocks of 32
template <int T, int MT>
inline void row32(const uint8_t* wr, const Act& a, int64_t i0, float* y, int64_t ldy) {
  using D = Dec32<T>;
  const int64_t nb = a.k / 32;
  __m256 acc[MT];
  float bias[MT];
  for (int t = 0; t < MT; t++) {
    acc[t] = _mm256_setzero_ps();
    bias[t] = 0.f;
  }
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = wr + b * D::BYTES;
    const __m256i q = D::codes(blk);
    const float d = f16(blk);
    const float mn = (T == Q4_1 || T == Q5_1) ? f16(blk + 2) : 0.f;
#pragma GCC unroll 4
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      const __m256i yv = _mm256_loadu_si256((const __m256i*)(a.q32 + ab * 32));
      const __m256 p = _mm256_cvtepi32_ps(D::dot(q, yv));
      acc[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * a.d32[ab]), acc[t]);
      if (T == Q4_0) bias[t] += -8.f * d * a.ds32[ab];
      if (T == Q5_0) bias[t] += -16.f * d * a.ds32[ab];
      if (T == Q4_1 || T == Q5_1) bias[t] += mn * a.s32[ab];
    }
  }
  for (int t = 0; t < MT; t++) y[(i0 + t) * ldy] = hsum(acc[t]) + bias[t];
}

// Q4_K / Q5_K: one super-block's 4 chunks of 64 (low nibbles: sub-block 2c, high: 2c + 1)
template <bool FIVE, int MT>
inline void row_qk45(const uint8_t* wr, const Act& a, int64_t i0, float* y, int64_t ldy) {
  constexpr int BYTES = FIVE ? 176 : 144;
  const int64_t nb = a.k / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc[MT];
  float bias[MT];
  for (int t = 0; t < MT; t++) {
    acc[t] = _mm256_setzero_ps();
    bias[t] = 0.f;
  }
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = wr + b * BYTES;
    const float d = f16(blk), dmin = f16(blk + 2);
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) k_scale_min(blk + 4, j, sc[j], mn[j]);
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    __m256i qh;
    if (FIVE) qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) isum[t] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
      __m256i lo = _mm256_and_si256(raw, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      if (FIVE) {
        const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
        const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
      }
      const __m256i s0 = _mm256_set1_epi16((short)sc[2 * c]);
      const __m256i s1 = _mm256_set1_epi16((short)sc[2 * c + 1]);
#pragma GCC unroll 4
      for (int t = 0; t < MT; t++) {
        const int8_t* yq = a.qK + ((i0 + t) * nb + b) * 256 + 64 * c;
        const __m256i y0 = _mm256_loadu_si256((const __m256i*)yq);
        const __m256i y1 = _mm256_loadu_si256((const __m256i*)(yq + 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s1);
        isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p0, p1));
      }
    }
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      const int16_t* bs = a.bsK + ab * 16;
      int32_t msum = 0;
      for (int j = 0; j < 8; j++) msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
      const float da = a.dK[ab];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(da * d), acc[t]);
      bias[t] -= da * dmin * (float)msum;
    }
  }
  for (int t = 0; t < MT; t++) y[(i0 + t) * ldy] = hsum(acc[t]) + bias[t];
}

// Q6_K: per half, four groups of 32 codes (6 bits, offset 32), two int8 scales per group
template <int MT>
inline void row_q6k(const uint8_t* wr, const Act& a, int64_t i0, float* y, int64_t ldy) {
  const int64_t nb = a.k / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  __m256 acc[MT];
  float bias[MT];
  for (int t = 0; t < MT; t++) {
    acc[t] = _mm256_setzero_ps();
    bias[t] = 0.f;
  }
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = wr + b * 210;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const float d = f16(blk + 208);
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) isum[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                             _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
      q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
      for (int g = 0; g < 4; g++) {
        const int s = 8 * h + 2 * g;  // the scales of elements 128 h + 32 g .. + 16, + 32
        const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
#pragma GCC unroll 4
        for (int t = 0; t < MT; t++) {
          const int8_t* yq = a.qK + ((i0 + t) * nb + b) * 256 + 128 * h + 32 * g;
          const __m256i yv = _mm256_loadu_si256((const __m256i*)yq);
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[g], yv), sv);
          isum[t] = _mm256_add_epi32(isum[t], p);
        }
      }
    }
    for (int t = 0; t < MT; t++) {
      const int64_t ab = (i0 + t) * nb + b;
      const int16_t* bs = a.bsK + ab * 16;
      int32_t off = 0;
      for (int s = 0; s < 16; s++) off += sc[s] * bs[s];
      const float dd = a.dK[ab] * d;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(dd), acc[t]);
      bias[t] -= 32.f * dd * (float)off;
    }
  }
  for (int t = 0; t < MT; t++) y[(i0 + t) * ldy] = hsum(acc[t]) + bias[t];
}

// IQ4_XS: eight sub-blocks of 32 levels, each with its 6-bit scale
template <int MT>
inline void row_iq4xs(const uint8_t* wr, const Act& a, int64_t i0, float* y, int64_t ldy) {
  const int64_t nb = a.k / 256;
  const __m256i lv = iq4_levels();
  __m256 acc[MT];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = wr + b * 136;
    const float d = f16(blk);
    __m256i isum[MT];
    for (int t = 0; t < MT; t++) isum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
      const __m256i q = _mm256_shuffle_epi8(lv, nibbles(blk + 8 + 16 * j));
      const __m256i qa = _mm256_sign_epi8(q, q);
      const __m256i sv = _mm256_set1_epi16((short)iq4xs_scale(blk, j));
#pragma GCC unroll 4
      for (int t = 0; t < MT; t++) {
        const int8_t* yq = a.qK + ((i0 + t) * nb + b) * 256 + 32 * j;
        const __m256i yv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)yq), q);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, yv), sv);
        isum[t] = _mm256_add_epi32(isum[t], p);
      }
    }
    for (int t = 0; t < MT; t++) {
      const float dd = a.dK[(i0 + t) * nb + b] * d;
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(dd), acc[t]);
    }
  }
  for (int t = 0; t < MT; t++) y[(i0 + t) * ldy] = hsum(acc[t]);
}

template <int T, int MT>
inline void row_any(const uint8_t* wr, const Act& a, int64_t i0, float* y, int64_t ldy) {
  if constexpr (T == Q4_K) row_qk45<false, MT>(wr, a, i0, y, ldy);
  else if constexpr (T == Q5_K) row_qk45<true, MT>(wr, a, i0, y, ldy);
  else if constexpr (T == Q6_K) row_q6k<MT>(wr, a, i0, y, ldy);
  else if constexpr (T == IQ4_XS) row_iq4xs<MT>(wr, a, i0, y, ldy);
  else row32<T, MT>(wr, a, i0, y, ldy);
}

// every weight row against every activation row, MT_MAX activation rows per pass: the tile of
// weight rows the caller gives stays in cache across the passes
template <int T>
void gemm_simd(const uint8_t* w, int64_t row_bytes, int64_t n, const Act& a, int64_t m,
               float* y, int64_t ldy) {
  for (int64_t i0 = 0; i0 < m; i0 += MT_MAX) {
    const int64_t mt = m - i0 < MT_MAX ? m - i0 : MT_MAX;
    for (int64_t r = 0; r < n; r++) {
      const uint8_t* wr = w + r * row_bytes;
      float* yr = y + r;
      switch (mt) {
        case 1: row_any<T, 1>(wr, a, i0, yr, ldy); break;
        case 2: row_any<T, 2>(wr, a, i0, yr, ldy); break;
        case 3: row_any<T, 3>(wr, a, i0, yr, ldy); break;
        default: row_any<T, 4>(wr, a, i0, yr, ldy); break;
      }
    }
  }
}
#endif  // __AVX2__

#include "qkernels_x8.h"
#include "qstep.h"
#include "kvrows.h"
#include "merged_attn.h"
#include "kivi_attn.h"  // KIVI
#include "tova_attn.h"

Table make_table() {
  Table t;
  std::memset(&t, 0, sizeof t);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  t.name = "avx512vnni";
#elif defined(__AVXVNNI__)
  t.name = "avxvnni";
#elif defined(__AVX2__)
  t.name = "avx2";
#else
  t.name = "portable";
#endif
  t.quant32 = quant32;
  t.quantK = quantK;
  t.rmsnorm = rmsnorm_row;
  t.rope = rope_row;
  t.silu_mul = silu_mul_row;
  t.attn_chunk = attn_chunk;
  t.attn_chunk_f16 = attn_chunk_f16;
  t.merged_chunk = merged_chunk;
  t.codebook_chunk = codebook_chunk;
  t.best_rows = best_rows;
  t.kivi_chunk = kivi_chunk;  // KIVI
  t.kivi_dequant = kivi_dequant;
  t.attn_chunk_scores = attn_chunk_scores;  // tova_attn.h
  t.attn_chunk_scores_f16 = attn_chunk_scores_f16;
  t.probs_row = probs_row;
  t.fold_row = fold_row;
  t.attn_rows_probs = attn_rows_probs;
#if defined(__AVX512F__)
  t.pack_kt = pack_kt;
#endif
#if defined(__AVX2__)
  t.gemm[Q4_0] = gemm_simd<Q4_0>;
  t.gemm[Q4_1] = gemm_simd<Q4_1>;
  t.gemm[Q5_0] = gemm_simd<Q5_0>;
  t.gemm[Q5_1] = gemm_simd<Q5_1>;
  t.gemm[Q8_0] = gemm_simd<Q8_0>;
  t.gemm[IQ4_NL] = gemm_simd<IQ4_NL>;
  t.gemm[Q4_K] = gemm_simd<Q4_K>;
  t.gemm[Q5_K] = gemm_simd<Q5_K>;
  t.gemm[Q6_K] = gemm_simd<Q6_K>;
  t.gemm[IQ4_XS] = gemm_simd<IQ4_XS>;
#else
  t.gemm[Q4_0] = gemm32_portable<Q4_0, 18>;
  t.gemm[Q4_1] = gemm32_portable<Q4_1, 20>;
  t.gemm[Q5_0] = gemm32_portable<Q5_0, 22>;
  t.gemm[Q5_1] = gemm32_portable<Q5_1, 24>;
  t.gemm[Q8_0] = gemm32_portable<Q8_0, 34>;
  t.gemm[IQ4_NL] = gemm32_portable<IQ4_NL, 18>;
  t.gemm[Q4_K] = gemmK_portable<Q4_K, 144>;
  t.gemm[Q5_K] = gemmK_portable<Q5_K, 176>;
  t.gemm[Q6_K] = gemmK_portable<Q6_K, 210>;
  t.gemm[IQ4_XS] = gemmK_portable<IQ4_XS, 136>;
#endif
  t.gemm_x8[Q4_0] = gemm_x8<Q4_0>;
  t.gemm_x8[Q4_1] = gemm_x8<Q4_1>;
  t.gemm_x8[Q5_0] = gemm_x8<Q5_0>;
  t.gemm_x8[Q5_1] = gemm_x8<Q5_1>;
  t.gemm_x8[Q8_0] = gemm_x8<Q8_0>;
  t.gemm_x8[IQ4_NL] = gemm_x8<IQ4_NL>;
  t.gemm_x8[Q4_K] = gemm_x8<Q4_K>;
  t.gemm_x8[Q5_K] = gemm_x8<Q5_K>;
  t.gemm_x8[Q6_K] = gemm_x8<Q6_K>;
  t.gemm_x8[IQ4_XS] = gemm_x8<IQ4_XS>;
  t.dequant[Q4_0] = dq_q4_0;
  t.dequant[Q4_1] = dq_q4_1;
  t.dequant[Q5_0] = dq_q5_0;
  t.dequant[Q5_1] = dq_q5_1;
  t.dequant[Q8_0] = dq_q8_0;
  t.dequant[IQ4_NL] = dq_iq4_nl;
  t.dequant[Q2_K] = dq_q2_k;
  t.dequant[Q3_K] = dq_q3_k;
  t.dequant[Q4_K] = dq_qk45<false>;
  t.dequant[Q5_K] = dq_qk45<true>;
  t.dequant[Q6_K] = dq_q6_k;
  t.dequant[IQ4_XS] = dq_iq4_xs;
  t.kv_load[KV_F16] = kv_load_f16;
  t.kv_load[KV_BF16] = kv_load_bf16;
  t.kv_load[KV_Q8_0] = kv_load_q8_0;
  t.kv_load[KV_Q4_0] = kv_load_q4_0;
  t.kv_store[KV_F16] = kv_store_f16;
  t.kv_store[KV_BF16] = kv_store_bf16;
  t.kv_store[KV_Q8_0] = kv_store_q8_0;
  t.kv_store[KV_Q4_0] = kv_store_q4_0;
  return t;
}

}  // namespace

extern "C" const kvq::Table* KVQ_TABLE() {
  static const kvq::Table table = make_table();
  return &table;
}
