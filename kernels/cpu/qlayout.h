// The 8-row interleaved ("x8") layout of GGUF blocks: made once at load, read by the products.
//
// A group holds 8 weight rows; for each block index b it stores the 8 rows' b-th blocks side by
// side: their scales as one vector of 8 (the products scale 8 rows with one instruction) and
// their codes in 4-byte runs, row after row, so one 32-byte load holds 4 codes of each of the
// 8 rows and multiplies with 4 activation codes broadcast to every lane. The values are the
// file's own (the same codes and scales, moved): unpack_x8 gives the GGUF blocks back, byte
// for byte. K-type scales are stored decoded (one byte per sub-block and row), a few percent
// more bytes than the file's packed 6-bit fields.
//
// Per group and block index (r: row in the group 0..7; "runs" are 4 bytes of one row):
//   Q4_0, IQ4_NL  d[8] f16 | qs: run j (0..3) of rows 0..7 (bytes 4j..4j+3)        144 bytes
//   Q4_1          d[8] f16 | m[8] f16 | qs as Q4_0                                   160
//   Q5_0          d[8] f16 | qh: rows 0..7 (4 bytes each) | qs as Q4_0                 176
//   Q5_1          d[8] f16 | m[8] f16 | qh as Q5_0 | qs as Q4_0                      192
//   Q8_0          d[8] f16 | qs: run e (0..7) of rows 0..7                            272
//   Q4_K          d[8] | dmin[8] f16 | sc[j][r] | mn[j][r] u8 (j: sub-block 0..7)
//                 | qs: chunk c (0..3), run e (0..7) of bytes 32c.. of rows 0..7      1184
//   Q5_K          as Q4_K, then qh: run e (0..7) of rows 0..7, before qs              1440
//   Q6_K          d[8] f16 | sc[s][r] i8 (s: 0..15) | ql: half h, part p (0..1),
//                 run e (0..7) of bytes 64h + 32p.. | qh: half h, run e of 32h..      1680
//   IQ4_XS        d[8] f16 | ls[j][r] i8 (scale - 32) | qs: sub-block j, run e (0..3)
//                 of bytes 16j.. of rows 0..7                                         1104
#pragma once

#include "qtypes.h"

namespace kvq {

constexpr int X8 = 8;  // rows per group

constexpr bool has_x8(int t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0 || t == IQ4_NL ||
         t == Q4_K || t == Q5_K || t == Q6_K || t == IQ4_XS;
}

// bytes of one group's blocks at one block index
constexpr int x8_bytes(int t) {
  switch (t) {
    case Q4_0: case IQ4_NL: return 144;
    case Q4_1: return 160;
    case Q5_0: return 176;
    case Q5_1: return 192;
    case Q8_0: return 272;
    case Q4_K: return 1184;
    case Q5_K: return 1440;
    case Q6_K: return 1680;
    case IQ4_XS: return 1104;
    default: return 0;
  }
}

// copy the n-byte runs of 8 rows: dst[(run * 8 + r) * n ..] = src_r[run * n ..]
inline void interleave_runs(uint8_t* dst, const uint8_t* const src[X8], int runs, int n) {
  for (int e = 0; e < runs; e++)
    for (int r = 0; r < X8; r++) std::memcpy(dst + (e * X8 + r) * n, src[r] + e * n, n);
}

inline void deinterleave_runs(uint8_t* dst, const uint8_t* src, int lane, int runs, int n) {
  for (int e = 0; e < runs; e++) std::memcpy(dst + e * n, src + (e * X8 + lane) * n, n);
}

inline void pack_k_scales(uint8_t* out, const int sc[8], const int mn[8]) {
  for (int j = 0; j < 4; j++) {
    out[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    out[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    out[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

// The 32-element types' blocks are fields in order (d; m; Q5's 32 fifth bits; the codes),
// each interleaved across the 8 rows in chunks (a scale whole, codes 4 bytes at a time): a
// field of B bytes at block offset o sits at o * 8 in the group. (bytes, chunk) per field.
struct Field {
  int bytes, chunk;
};
inline int fields32(int t, Field f[4]) {
  switch (t) {
    case Q4_0: case IQ4_NL: f[0] = {2, 2}; f[1] = {16, 4}; return 2;
    case Q4_1: f[0] = {2, 2}; f[1] = {2, 2}; f[2] = {16, 4}; return 3;
    case Q5_0: f[0] = {2, 2}; f[1] = {4, 4}; f[2] = {16, 4}; return 3;
    case Q5_1: f[0] = {2, 2}; f[1] = {2, 2}; f[2] = {4, 4}; f[3] = {16, 4}; return 4;
    case Q8_0: f[0] = {2, 2}; f[1] = {32, 4}; return 2;
    default: return 0;
  }
}

// one block index of 8 rows (src[r]: row r's block; rows past the matrix point at zeros)
inline void repack_x8(int t, uint8_t* dst, const uint8_t* const src[X8]) {
  const uint8_t* p[X8];
  auto at = [&](int off) {
    for (int r = 0; r < X8; r++) p[r] = src[r] + off;
    return p;
  };
  Field f[4];
  if (const int nf = fields32(t, f)) {
    for (int i = 0, off = 0; i < nf; off += f[i].bytes, i++)
      interleave_runs(dst + off * X8, at(off), f[i].bytes / f[i].chunk, f[i].chunk);
    return;
  }
  switch (t) {
    case Q4_K: case Q5_K: {
      const bool five = t == Q5_K;
      interleave_runs(dst, at(0), 1, 2);
      interleave_runs(dst + 16, at(2), 1, 2);
      for (int r = 0; r < X8; r++)
        for (int j = 0; j < 8; j++) {
          int sc, mn;
          k_scale_min(src[r] + 4, j, sc, mn);
          dst[32 + j * X8 + r] = (uint8_t)sc;
          dst[96 + j * X8 + r] = (uint8_t)mn;
        }
      uint8_t* q = dst + 160;
      if (five) {
        interleave_runs(q, at(16), 8, 4);
        q += 256;
      }
      for (int c = 0; c < 4; c++) interleave_runs(q + 256 * c, at((five ? 48 : 16) + 32 * c), 8, 4);
      break;
    }
    case Q6_K:
      interleave_runs(dst, at(208), 1, 2);
      for (int r = 0; r < X8; r++)
        for (int s = 0; s < 16; s++) dst[16 + s * X8 + r] = src[r][192 + s];
      for (int h = 0; h < 2; h++) {
        for (int part = 0; part < 2; part++)
          interleave_runs(dst + 144 + 256 * (2 * h + part), at(64 * h + 32 * part), 8, 4);
        interleave_runs(dst + 1168 + 256 * h, at(128 + 32 * h), 8, 4);
      }
      break;
    case IQ4_XS:
      interleave_runs(dst, at(0), 1, 2);
      for (int r = 0; r < X8; r++)
        for (int j = 0; j < 8; j++) {
          const int lo = (src[r][4 + j / 2] >> (4 * (j % 2))) & 0xF;
          const int hi = (load_u16(src[r] + 2) >> (2 * j)) & 3;
          dst[16 + j * X8 + r] = (uint8_t)(int8_t)((lo | (hi << 4)) - 32);
        }
      for (int j = 0; j < 8; j++) interleave_runs(dst + 80 + 128 * j, at(8 + 16 * j), 4, 4);
      break;
  }
}

// the GGUF block of row `lane` back from one block index of a group
inline void unpack_x8(int t, uint8_t* out, const uint8_t* src, int lane) {
  Field f[4];
  if (const int nf = fields32(t, f)) {
    for (int i = 0, off = 0; i < nf; off += f[i].bytes, i++)
      deinterleave_runs(out + off, src + off * X8, lane, f[i].bytes / f[i].chunk, f[i].chunk);
    return;
  }
  switch (t) {
    case Q4_K: case Q5_K: {
      const bool five = t == Q5_K;
      deinterleave_runs(out, src, lane, 1, 2);
      deinterleave_runs(out + 2, src + 16, lane, 1, 2);
      int sc[8], mn[8];
      for (int j = 0; j < 8; j++) {
        sc[j] = src[32 + j * X8 + lane];
        mn[j] = src[96 + j * X8 + lane];
      }
      pack_k_scales(out + 4, sc, mn);
      const uint8_t* q = src + 160;
      if (five) {
        deinterleave_runs(out + 16, q, lane, 8, 4);
        q += 256;
      }
      for (int c = 0; c < 4; c++)
        deinterleave_runs(out + (five ? 48 : 16) + 32 * c, q + 256 * c, lane, 8, 4);
      break;
    }
    case Q6_K:
      deinterleave_runs(out + 208, src, lane, 1, 2);
      for (int s = 0; s < 16; s++) out[192 + s] = src[16 + s * X8 + lane];
      for (int h = 0; h < 2; h++) {
        for (int part = 0; part < 2; part++)
          deinterleave_runs(out + 64 * h + 32 * part, src + 144 + 256 * (2 * h + part), lane, 8, 4);
        deinterleave_runs(out + 128 + 32 * h, src + 1168 + 256 * h, lane, 8, 4);
      }
      break;
    case IQ4_XS: {
      deinterleave_runs(out, src, lane, 1, 2);
      uint16_t sh = 0;
      for (int j = 0; j < 8; j++) {
        const int ls = (int)(int8_t)src[16 + j * X8 + lane] + 32;
        if (j % 2 == 0) out[4 + j / 2] = 0;
        out[4 + j / 2] |= (uint8_t)((ls & 0xF) << (4 * (j % 2)));
        sh |= (uint16_t)(((ls >> 4) & 3) << (2 * j));
      }
      std::memcpy(out + 2, &sh, 2);
      for (int j = 0; j < 8; j++) deinterleave_runs(out + 8 + 16 * j, src + 80 + 128 * j, lane, 4, 4);
      break;
    }
  }
}

}  // namespace kvq
