// GGUF block types, the 8-bit activation blocks they multiply with, and the table of kernels one
// instruction set provides. Shared by qkernels.cpp (compiled once per instruction set, no torch)
// and qops.cpp (the torch ops, which pick a table at run time).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "merged_types.h"  // MiniCache's and SpindleKV's attention (merged_attn.h)

namespace kvq {

// ggml's type numbers (gguf.GGMLQuantizationType)
enum Type : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
  Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, NTYPES = 64,
};

// A weight's code in the ops' type lists: its type, plus X8_FLAG where it is interleaved.
constexpr int X8_FLAG = 256;

// Which activation blocks a type's dot product reads.
enum Act8 : int { ACT_NONE = 0, ACT_Q8_0 = 1, ACT_Q8_1 = 2, ACT_Q8_K = 3 };

struct TypeInfo {
  int block;  // elements per block
  int bytes;  // bytes per block
  int act;    // Act8 of its dot product (ACT_NONE: dequantized only)
};

constexpr TypeInfo type_info(int t) {
  switch (t) {
    case Q4_0: return {32, 18, ACT_Q8_0};
    case Q4_1: return {32, 20, ACT_Q8_1};
    case Q5_0: return {32, 22, ACT_Q8_0};
    case Q5_1: return {32, 24, ACT_Q8_1};
    case Q8_0: return {32, 34, ACT_Q8_0};
    case IQ4_NL: return {32, 18, ACT_Q8_0};
    case Q2_K: return {256, 84, ACT_NONE};
    case Q3_K: return {256, 110, ACT_NONE};
    case Q4_K: return {256, 144, ACT_Q8_K};
    case Q5_K: return {256, 176, ACT_Q8_K};
    case Q6_K: return {256, 210, ACT_Q8_K};
    case IQ4_XS: return {256, 136, ACT_Q8_K};
    default: return {0, 0, ACT_NONE};
  }
}

// IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit code stands for
static const int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

// Activations of m rows quantized to 8 bits, as llama.cpp quantizes them for each type's dot
// product. Row i of each array starts at i * (its per-row length).
struct Act {
  int64_t k;  // elements per row
  // blocks of 32 (q8_0 / q8_1): codes, the fp16-rounded scale, the sum of the codes,
  // d * sum as float (exact) and as q8_1 keeps it (rounded to fp16)
  const int8_t* q32;
  const float* d32;
  const int32_t* sum32;
  const float* ds32;
  const float* s32;
  // blocks of 256 (q8_K): codes, the float scale, sums of each 16 codes
  const int8_t* qK;
  const float* dK;
  const int16_t* bsK;
};

// y[i * ldy + r] = dot(weight row r, activation row i) for r < n, i < m; w: n rows of
// row_bytes bytes (whole blocks).
typedef void (*GemmFn)(const uint8_t* w, int64_t row_bytes, int64_t n, const Act& a, int64_t m,
                       float* y, int64_t ldy);
// one weight row of k elements -> float32, the values gguf.quants.dequantize gives
typedef void (*DequantFn)(const uint8_t* w, int64_t k, float* out);
// one activation row -> q8_0/q8_1 blocks (q, d, sum, d * sum, fp16(d * sum))
typedef void (*Quant32Fn)(const float* x, int64_t k, int8_t* q, float* d, int32_t* sum,
                          float* ds, float* s);
// one activation row -> q8_K blocks (q, d, bsums)
typedef void (*QuantKFn)(const float* x, int64_t k, int8_t* q, float* d, int16_t* bs);
// a K or V row of d float32 values -> a KV cache row of one of the KV types (kvrows.h)
typedef void (*KvStoreFn)(const float* x, int64_t d, uint8_t* out);

// the element types a dense KV store holds (ggml's numbers): float32, f16, bf16, q8_0, q4_0
enum KvType : int { KV_F32 = 0, KV_F16 = 1, KV_Q4_0 = 2, KV_Q8_0 = 8, KV_BF16 = 30, KV_NTYPES = 32 };

// bytes of a row of d values in a KV type (q8_0 / q4_0: d a multiple of 32)
constexpr int64_t kv_row_bytes(int t, int64_t d) {
  return t == KV_F32 ? 4 * d : t == KV_F16 || t == KV_BF16 ? 2 * d : t == KV_Q8_0 ? d / 32 * 34 : t == KV_Q4_0 ? d / 32 * 18 : 0;
}

// the rest of a decode step (qstep.h)
typedef void (*RowFn)(const float* x, const float* w, float eps, float* y, int64_t d);
typedef void (*RopeFn)(const float* x, const float* cos, const float* ssin, float* y, int64_t d);
typedef void (*SiluMulFn)(const float* g, const float* u, float* y, int64_t n);
typedef void (*AttnFn)(const float* q, int g, const float* k, int64_t ks, const float* v,
                       int64_t vs, int64_t t, int64_t d, float scale, float* out, float* mx,
                       float* sm, float* scores);

// ---- KIVI (kivi_attn.h): one KV head of a packed body (kvrun/kv/stores/kivi.py's layout: the
// public KIVI one's codes, the keys block-major), each pointer at the head's first token; code
// i of a word sits at bits [b*i, b*i + b)
struct KiviHead {
  const int32_t* kc;  // key words: group g's channel c at kc + g * kc_g + c * kc_c, its G
  int64_t kc_g, kc_c;  // tokens packed along
  const void* ks;  // key scales and zeros: group g's d channels at ks + g * ks_g
  const void* kz;  // (and kz + g * kz_g)
  int64_t ks_g, kz_g;
  const int32_t* vc;  // value words, token t's at vc + t * vc_t: channels packed along
  int64_t vc_t;
  const void* vs;  // value scales and zeros, token t's groups of G channels at + t * vs_t
  const void* vz;  // (and + t * vz_t)
  int64_t vs_t, vz_t;
  bool half = false;  // scales and zeros in float16 (the KV dtype's), else float32
  // the scales and zeros as S: float, or uint16_t (float16 bits) where half
  template <typename S> const S* kscale() const { return static_cast<const S*>(ks); }
  template <typename S> const S* kzero() const { return static_cast<const S*>(kz); }
  template <typename S> const S* vscale() const { return static_cast<const S*>(vs); }
  template <typename S> const S* vzero() const { return static_cast<const S*>(vz); }
  // minicache+kivi4's merged pair (kivi_merged_attn; null for a plain store): token t's scores
  // times kf[t] * kfi[t] and its value weights times vf[t] * vfi[t] (the layer's norm n, times
  // 1 / ||E||); a retained token's exact row in its restored one's place: nk ascending token
  // indices kr, their rows krow (nk, d); the values' vr, vrow, nv likewise
  const float* kf = nullptr;
  const float* kfi = nullptr;
  const float* vf = nullptr;
  const float* vfi = nullptr;
  const int32_t* kr = nullptr;
  const float* krow = nullptr;
  int64_t nk = 0;
  const int32_t* vr = nullptr;
  const float* vrow = nullptr;
  int64_t nv = 0;
};

// body tokens a KIVI chunk scores at once (whole groups: at least 4, about 128 tokens)
inline int64_t kivi_block(int64_t group) { return group * std::max<int64_t>(4, (256 + group - 1) / group); }

// floats of scratch a KIVI chunk needs for r rows
inline int64_t kivi_scratch(int64_t r, int64_t d, int64_t group) {
  const int64_t kb = kivi_block(group), gd = d / group;
  return r * (2 * kb + d + 2 + kb * gd + gd) + 2 * kb * gd + 64;  // (+ r * kb: kivi_merged)
}

// KIVI body attention of r query rows q (r, d), already multiplied by the softmax scale, over
// body tokens [j0, j0 + n) (whole groups) of one head: out (r, d) the value rows weighted by
// exp(score - mx), mx and sm (r) as AttnFn's; lim (r) or nullptr: row i sees tokens t < lim[i]
typedef void (*KiviChunkFn)(const float* q, int64_t r, const KiviHead& b, int bits, int group,
                            int64_t j0, int64_t n, int64_t d, const int64_t* lim, float* out,
                            float* mx, float* sm, float* scratch);
// body tokens [t0, t0 + n) (whole groups) of one head dequantized: k, v (n, d) rows,
// code * scale + zero (the torch reference's arithmetic: a product, then a sum)
typedef void (*KiviDequantFn)(const KiviHead& b, int bits, int group, int64_t t0, int64_t n,
                              int64_t d, float* k, float* v);
// ---- end KIVI
// attention that keeps its probabilities (tova_attn.h)
typedef void (*AttnScoresFn)(const float* q, int g, const float* k, int64_t ks, const float* v,
                             int64_t vs, int64_t t, int64_t d, float scale, float* out, float* mx,
                             float* sm, float* scores, float* sout, int64_t ldo);
typedef void (*AttnScoresF16Fn)(const float* q, int g, const uint16_t* k, int64_t ks,
                                const uint16_t* v, int64_t vs, int64_t t, int64_t d,
                                float scale, float* out, float* mx, float* sm, float* scores,
                                float* sout, int64_t ldo);
typedef void (*ProbsRowFn)(float* s, int64_t n, float lse);
typedef void (*FoldRowFn)(const float* x, int64_t n, float w, int mode, float* y);
typedef void (*AttnRowsFn)(const float* q, int R, int64_t d, const float* k, int64_t ks,
                           const float* kt, const float* v, int64_t vs, int64_t n, float scale,
                           const int32_t* kp, const int64_t* lim, int64_t win, float* out,
                           float* lse, float* s, int64_t ls);
typedef void (*PackKtFn)(const float* k, int64_t ks, int64_t n, int64_t d, float* kt);

// attn_chunk over float16 K/V rows (--kv-dtype f16), converted in the loads
typedef void (*AttnF16Fn)(const float* q, int g, const uint16_t* k, int64_t ks,
                          const uint16_t* v, int64_t vs, int64_t t, int64_t d, float scale,
                          float* out, float* mx, float* sm, float* scores);

struct Table {
  const char* name;
  RowFn rmsnorm;
  RopeFn rope;
  SiluMulFn silu_mul;
  AttnFn attn_chunk;
  AttnF16Fn attn_chunk_f16;
  KiviChunkFn kivi_chunk;  // KIVI (kivi_attn.h)
  KiviDequantFn kivi_dequant;
  Quant32Fn quant32;
  QuantKFn quantK;
  GemmFn gemm[NTYPES];     // row-major GGUF blocks
  GemmFn gemm_x8[NTYPES];  // the 8-row interleaved layout (qlayout.h); row_bytes: per group
  DequantFn dequant[NTYPES];
  DequantFn kv_load[KV_NTYPES];  // a KV cache row -> float32 (KV_F32: none, read in place)
  KvStoreFn kv_store[KV_NTYPES];
  // MiniCache's merged pairs and SpindleKV's codebook slots (merged_attn.h)
  MergedChunkFn merged_chunk;
  CodebookChunkFn codebook_chunk;
  BestRowFn best_rows;
  // attention that keeps its probabilities (tova_attn.h)
  AttnScoresFn attn_chunk_scores;
  AttnScoresF16Fn attn_chunk_scores_f16;
  ProbsRowFn probs_row;
  FoldRowFn fold_row;
  AttnRowsFn attn_rows_probs;
  PackKtFn pack_kt;  // null where the broadcast product does not pay (no AVX-512)
};

// fp16 <-> fp32 without F16C (round to nearest even, as F16C's _cvtss_sh(x, 0) does)
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      e++;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t ax = x & 0x7FFFFFFF;
  if (ax >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0));
  if (ax >= 0x477FF000) return (uint16_t)(sign | 0x7C00);  // rounds past the largest half
  if (ax < 0x38800000) {  // subnormal half (or zero): round ax * 2^24 to an integer, RNE
    float a;
    std::memcpy(&a, &ax, 4);
    const float scaled = a * 16777216.0f;  // exact: a power of two
    const uint32_t r = (uint32_t)__builtin_nearbyintf(scaled);
    return (uint16_t)(sign | r);
  }
  const uint32_t mant = ax & 0x7FFFFF;
  uint32_t h = ((ax >> 23) - 112) << 10 | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace kvq

extern "C" {
const kvq::Table* kvq_table_generic();
const kvq::Table* kvq_table_avx2();
const kvq::Table* kvq_table_avx512vnni();
const kvq::Table* kvq_table_avxvnni();
}
