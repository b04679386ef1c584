// What the native attention over MiniCache's merged pairs and SpindleKV's codebook slots
// (merged_attn.h, one copy per instruction set) reads: plain pointers and strides in elements,
// filled by qops.cpp from the torch tensors. Included by qtypes.h.
#pragma once

#include <cstdint>

namespace kvq {

// Element types of the stored rows (E, retained rows, codebook rows) and magnitudes.
enum Elem : int { EL_F32 = 0, EL_F16 = 1 };

// One half (K or V) of a MiniCache pair for the merged kernel: token j of KV head h restores
// to E[h, j] * scale[h, j] (/ ||E[h, j]|| with unit), or to its retained exact row.
struct MergedHalf {
  const void* e;  // E row (h, j) at e + h * e_h + j * e_t (elements of `elem`)
  int64_t e_h, e_t;
  const float* scale;  // the layer's norm (unit) or the whole factor, at h * s_h + j * s_t
  int64_t s_h, s_t;
  // retained rows: group gr = h * r_grp (r_grp 0: one group for the whole layer) holds token
  // indices ridx[roff[gr] .. roff[gr + 1]), ascending; its r-th row of head h is at
  // rows + r * r_row + h * r_col
  const int32_t* ridx;
  const int64_t* roff;
  const void* rows;
  int64_t r_row, r_col, r_grp;
};

struct MergedArgs {
  const float* q;  // (Hkv, R, d): KV head h's R query rows, contiguous
  int64_t R, d;
  float scale;  // 1 / sqrt(d)
  int elem;     // Elem of E and the retained rows
  int unit;     // 1: the factor is scale / ||E|| (0 where ||E|| = 0)
  MergedHalf k, v;
};

// SpindleKV's slots for the codebook kernel. Slot s of KV head h: key RoPE(row_k * mag_k, pos),
// value row_v * mag_v, where row = book[off[h] + idx[h, s]] (coded) or book[h, s] (dense:
// idx null, magnitude 1); query head j of the group sees it where bit j of its mask is set.
struct BookSide {
  const void* book;  // coded: row i at book + i * b_r; dense: slot (h, s) at h * b_h + s * b_r
  int64_t b_h, b_r;
  const void* idx;  // (Hkv, S) int16 / int32 / int64 (idx_bytes), or null (dense)
  int idx_bytes;
  int64_t i_h, i_s;
  const void* mag;  // (Hkv, S) of mag_elem, or null
  int mag_elem;
  int64_t m_h, m_s;
  const int32_t* off;  // (Hkv,) first row of head h's book, or null (0)
};

struct CodebookArgs {
  const float* q;  // (Hkv, R, d), R = g * tq: row r is query head h * g + r / tq
  int64_t R, d, tq;
  float scale;
  int elem;  // Elem of both books
  BookSide k, v;
  const int32_t* pos;  // (Hkv, S) at h * p_h + s * p_s
  int64_t p_h, p_s;
  const float* cos;  // RoPE tables (P, d), rows cat(ang, ang): the first d / 2 are read
  const float* sin;
  int64_t cs_r;
  const uint8_t* mask;  // (Hkv, S, nb) keep bits at h * k_h + s * k_s + byte, or null
  int64_t k_h, k_s;
};

typedef void (*MergedChunkFn)(const MergedArgs& a, int64_t h, int64_t j0, int64_t n, float* part,
                              float* mx, float* sm, float* scratch);
typedef void (*CodebookChunkFn)(const CodebookArgs& a, int64_t h, int64_t j0, int64_t n,
                                float* part, float* mx, float* sm, float* scratch);
// For each of nu float32 rows u (nu, d): the first of n rows of `elem` at book + i * stride
// with the largest dot product, into best[a] and arg[a] as they come in (ties keep the earlier).
// `floor`: only rows above it are wanted (-inf: every row); rows that cannot pass it may be
// left out, so best and arg are exact only where best > floor (the rows are unit vectors).
typedef void (*BestRowFn)(const float* u, int64_t nu, const void* book, int elem, int64_t stride,
                          int64_t n, int64_t d, float floor, float* best, int64_t* arg);

}  // namespace kvq
