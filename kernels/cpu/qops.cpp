// The torch ops over qkernels.cpp's tables (torch.ops.kvrun_cpu.*):
//
//   qmm(x, ws, codes, rows) -> y  x (M, K) float32 @ [w_0; w_1; ...]^T -> (M, sum N_i) float32;
//                                 w_i: rows[i] rows of GGUF blocks of type codes[i], row-major
//                                 (N, K / block * bytes) uint8, or (codes[i] | X8_FLAG) in the
//                                 8-row interleaved layout (ceil(N / 8), group bytes)
//   dequant(w, code, n, k, idx) -> (R, K) float32: rows idx (or all), the values
//                                 gguf.quants.dequantize gives
//   repack(w, type, k) / unpack(w, type, n, k): row-major blocks <-> interleaved layout
//   quantize_act(x, kind) -> [q, d, s or bsums]: the activation blocks a product makes
//   rmsnorm, rope, silu_mul, attn_decode: the rest of a decode step (qstep.h), float32
//   attn_partial: one segment's attention (out, lse) over float32 K/V, every key visible
//   attn_in, attn_out: a decoder layer's decode step before and after attention, fused
//   rope_append_attend: a plain dense cache's decode row (rotate, store, attend) in one call
//   attn_probs: a decode row's attention (out) and the probabilities it used (p), optionally
//                 added to accumulated scores (H2O) (tova_attn.h)
//   rope_append_probs: rope_append_attend that also gives those probabilities (and appends
//                 the new slot's position and accumulated score)
//   attn_colsum: a prefill chunk's causal attention and each key's probability summed (or the
//                 maximum) over the rows and heads (H2O, MiniKV, KVzip)
//   evict_one: one slot out per KV head (or layer) by scores and position rank, the last slot
//                 written over it (TOVA / H2O at their budget: no compaction)
//   refine_top: the output head's top logits recomputed from the exact weights
//   isa() -> str                  the instruction set the products run on
//   set_isa(name) -> str          pick one ("best", "portable", "avx2", ...); returns the one taken
//   has_gemm(code) -> bool        whether a type (| X8_FLAG) has a native product here
//   threads_used() -> int         how many of torch's threads one parallel region here runs on
//
// x is quantized once per call (q8_0/q8_1 and/or q8_K, as the types read them) and shared by
// every weight in the call: Q, K and V of a layer (or gate and up) make one call even where
// their types differ. Threads: PyTorch's own pool (at::parallel_for), over tiles of weight rows
// handed out as threads ask (dynamic_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "qlayout.h"
#include "qtypes.h"

namespace {

using kvq::Table;

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (std::string(feature) == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (std::string(feature) == "avx512vnni")
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
  if (std::string(feature) == "avxvnni")
    return __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
#endif
  (void)feature;
  return false;
}

// the tables built into this library, best first (KVQ_HAVE_* say which files were compiled)
std::vector<const Table*> available() {
  std::vector<const Table*> out;
#ifdef KVQ_HAVE_AVX512VNNI
  if (cpu_has("avx512vnni")) out.push_back(kvq_table_avx512vnni());
#endif
#ifdef KVQ_HAVE_AVXVNNI
  if (cpu_has("avxvnni")) out.push_back(kvq_table_avxvnni());
#endif
#ifdef KVQ_HAVE_AVX2
  if (cpu_has("avx2")) out.push_back(kvq_table_avx2());
#endif
  out.push_back(kvq_table_generic());
  return out;
}

const Table*& current() {
  static const Table* table = available().front();
  return table;
}

std::string isa() { return current()->name; }

std::string set_isa(const std::string& name) {
  const auto tables = available();
  if (name == "best") {
    current() = tables.front();
    return isa();
  }
  for (const Table* t : tables)
    if (name == t->name) {
      current() = t;
      return isa();
    }
  std::string have;
  for (const Table* t : tables) have += std::string(have.empty() ? "" : ", ") + t->name;
  TORCH_CHECK(false, "instruction set '", name, "' is not available here (", have, ")");
}

bool has_gemm(int64_t code) {
  const int64_t type = code & ~(int64_t)kvq::X8_FLAG;
  if (type < 0 || type >= kvq::NTYPES) return false;
  return ((code & kvq::X8_FLAG) ? current()->gemm_x8 : current()->gemm)[type] != nullptr;
}

struct Weight {  // one weight of a call: its tensor, type, layout and rows
  const at::Tensor* t;
  int type;
  bool x8;
  int64_t n;
  int64_t row_bytes;  // bytes of one row's blocks (row-major) or of one group's (x8)
};

Weight check_weight(const at::Tensor& w, int64_t code, int64_t n, int64_t k) {
  const int type = (int)(code & ~(int64_t)kvq::X8_FLAG);
  const bool x8 = (code & kvq::X8_FLAG) != 0;
  TORCH_CHECK(type >= 0 && type < kvq::NTYPES, "unknown GGUF type ", type);
  const kvq::TypeInfo ti = kvq::type_info(type);
  TORCH_CHECK(ti.block > 0, "GGUF type ", type, " has no native kernel");
  TORCH_CHECK(!x8 || kvq::has_x8(type), "GGUF type ", type, " has no interleaved layout");
  TORCH_CHECK(k % ti.block == 0, "K = ", k, " is not a multiple of the block size ", ti.block);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              "weights must be a contiguous 2-D uint8 CPU tensor");
  const int64_t nb = k / ti.block;
  const int64_t row_bytes = x8 ? nb * kvq::x8_bytes(type) : nb * ti.bytes;
  const int64_t rows = x8 ? (n + kvq::X8 - 1) / kvq::X8 : n;
  TORCH_CHECK(w.size(0) == rows && w.size(1) == row_bytes, "weight of type ", type,
              (x8 ? " (interleaved)" : ""), " is ", w.size(0), " x ", w.size(1), " bytes, not the ",
              rows, " x ", row_bytes, " of ", n, " x ", k, " elements");
  return {&w, type, x8, n, row_bytes};
}

// the activation buffers of one call, filled for the block kinds its types read
struct ActBuffers {
  std::vector<int8_t> q32, qK;
  std::vector<float> d32, ds32, s32, dK;
  std::vector<int32_t> sum32;
  std::vector<int16_t> bsK;
  kvq::Act act{};

  ActBuffers(const float* x, int64_t m, int64_t k, bool need32, bool needK, const Table* t) {
    act.k = k;
    if (need32) {
      const int64_t nb = k / 32;
      q32.resize(m * k);
      d32.resize(m * nb);
      sum32.resize(m * nb);
      ds32.resize(m * nb);
      s32.resize(m * nb);
      for (int64_t i = 0; i < m; i++)
        t->quant32(x + i * k, k, q32.data() + i * k, d32.data() + i * nb, sum32.data() + i * nb,
                   ds32.data() + i * nb, s32.data() + i * nb);
      act.q32 = q32.data();
      act.d32 = d32.data();
      act.sum32 = sum32.data();
      act.ds32 = ds32.data();
      act.s32 = s32.data();
    }
    if (needK) {
      const int64_t nb = k / 256;
      qK.resize(m * k);
      dK.resize(m * nb);
      bsK.resize(m * nb * 16);
      for (int64_t i = 0; i < m; i++)
        t->quantK(x + i * k, k, qK.data() + i * k, dK.data() + i * nb, bsK.data() + i * nb * 16);
      act.qK = qK.data();
      act.dK = dK.data();
      act.bsK = bsK.data();
    }
  }
};

// [0, n) in chunks of at least `grain`, handed out to torch's threads as each asks for the
// next (an atomic counter, as ggml's threads take chunks): a thread the OS holds back (a
// server's event loop or another job on a small machine, a busy vCPU) then takes fewer chunks
// instead of making the whole call wait for its fixed half. Each index still runs once, so
// results do not depend on the schedule.
template <class F>
void dynamic_for(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) return f(0, n);
  const int64_t chunk = std::max<int64_t>(grain, n / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk))
      f(b, std::min(n, b + chunk));
  });
}

constexpr int64_t TILE_ROWS = 16;  // weight rows a task takes (two interleaved groups)

// the weights of one call, checked, with their output columns
struct Call {
  std::vector<Weight> wts;
  std::vector<int64_t> start{0};       // first output column of each weight
  std::vector<int64_t> tile_start{0};  // first tile of each weight
  bool need32 = false, needK = false;

  Call(at::TensorList ws, at::IntArrayRef codes, at::IntArrayRef rows, int64_t k, const Table* t) {
    TORCH_CHECK(ws.size() == codes.size() && ws.size() == rows.size() && !ws.empty(),
                "one type and one row count per weight");
    for (size_t i = 0; i < ws.size(); i++) {
      const Weight w = check_weight(ws[i], codes[i], rows[i], k);
      TORCH_CHECK((w.x8 ? t->gemm_x8 : t->gemm)[w.type] != nullptr, "GGUF type ", w.type,
                  " has no native product (dequantize it)");
      const int act = kvq::type_info(w.type).act;
      need32 |= act == kvq::ACT_Q8_0 || act == kvq::ACT_Q8_1;
      needK |= act == kvq::ACT_Q8_K;
      wts.push_back(w);
      start.push_back(start.back() + w.n);
      tile_start.push_back(tile_start.back() + (w.n + TILE_ROWS - 1) / TILE_ROWS);
    }
  }
  int64_t n() const { return start.back(); }

  // y (m, n()) = x (m, k) @ W^T, x quantized once for every weight
  void run(const float* x, int64_t m, int64_t k, float* y, const Table* t) const {
    if (m == 0 || n() == 0) return;
    const ActBuffers buf(x, m, k, need32, needK, t);
    const int64_t n_all = n();
    // enough tiles per task that a task is worth a thread's wake-up (~16 KB of weights)
    const int64_t tile_bytes = TILE_ROWS * k / 2;
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile_bytes));
    dynamic_for(tile_start.back(), grain, [&](int64_t b, int64_t e) {
      size_t seg = 0;
      for (int64_t tile = b; tile < e; tile++) {
        while (tile >= tile_start[seg + 1]) seg++;
        const Weight& w = wts[seg];
        const int64_t r0 = (tile - tile_start[seg]) * TILE_ROWS;
        const int64_t cnt = std::min<int64_t>(TILE_ROWS, w.n - r0);
        const uint8_t* base = w.t->data_ptr<uint8_t>();
        if (w.x8)
          t->gemm_x8[w.type](base + r0 / kvq::X8 * w.row_bytes, w.row_bytes, cnt, buf.act, m,
                             y + start[seg] + r0, n_all);
        else
          t->gemm[w.type](base + r0 * w.row_bytes, w.row_bytes, cnt, buf.act, m,
                          y + start[seg] + r0, n_all);
      }
    });
  }
};

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
}

at::Tensor qmm(const at::Tensor& x, at::TensorList ws, at::IntArrayRef codes,
               at::IntArrayRef rows) {
  check_x(x);
  const Table* t = current();
  const Call call(ws, codes, rows, x.size(1), t);
  at::Tensor y = at::empty({x.size(0), call.n()}, x.options());
  call.run(x.data_ptr<float>(), x.size(0), x.size(1), y.data_ptr<float>(), t);
  return y;
}

// row r's GGUF blocks (row_bytes of them) from a weight in either layout
void row_blocks(const Weight& w, int64_t r, uint8_t* out) {
  const uint8_t* base = w.t->data_ptr<uint8_t>();
  if (!w.x8) {
    std::memcpy(out, base + r * w.row_bytes, w.row_bytes);
    return;
  }
  const kvq::TypeInfo ti = kvq::type_info(w.type);
  const int gb = kvq::x8_bytes(w.type);
  const uint8_t* g = base + r / kvq::X8 * w.row_bytes;
  for (int64_t b = 0; b < w.row_bytes / gb; b++)
    kvq::unpack_x8(w.type, out + b * ti.bytes, g + b * gb, (int)(r % kvq::X8));
}

// rows idx (or all, idx undefined) dequantized to float32 (R, K)
at::Tensor dequant(const at::Tensor& wt, int64_t code, int64_t n, int64_t k,
                   const c10::optional<at::Tensor>& idx, const c10::optional<at::Tensor>& out_) {
  const Weight w = check_weight(wt, code, n, k);
  const kvq::DequantFn fn = current()->dequant[w.type];
  TORCH_CHECK(fn != nullptr, "GGUF type ", w.type, " has no native dequantization");
  at::Tensor ids;
  if (idx.has_value()) {
    ids = idx->to(at::kLong).contiguous();
    TORCH_CHECK(ids.dim() == 1, "row indices must be 1-D");
  }
  const int64_t count = idx.has_value() ? ids.size(0) : n;
  const int64_t* ip = idx.has_value() ? ids.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < (ip ? count : 0); i++)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "row index ", ip[i], " out of range for ", n, " rows");
  at::Tensor out;
  if (out_.has_value()) {  // a reused buffer: fresh multi-megabyte tensors cost page faults
    out = *out_;
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == count * k,
                "dequant: out must be a contiguous float32 tensor of ", count * k, " elements");
  } else {
    out = at::empty({count, k}, wt.options().dtype(at::kFloat));
  }
  float* op = out.data_ptr<float>();
  const int64_t blocks_bytes = k / kvq::type_info(w.type).block * kvq::type_info(w.type).bytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, k));
  at::parallel_for(0, count, grain, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> tmp(w.x8 ? blocks_bytes : 0);
    for (int64_t i = b; i < e; i++) {
      const int64_t r = ip ? ip[i] : i;
      const uint8_t* src = w.t->data_ptr<uint8_t>() + r * w.row_bytes;
      if (w.x8) {
        row_blocks(w, r, tmp.data());
        src = tmp.data();
      }
      fn(src, k, op + i * k);
    }
  });
  return out;
}

// Ask the kernel for 2 MiB pages over the whole 2 MiB stretches of [p, p + n) before they are
// first written (transparent huge pages in "madvise" mode, the common default): a decode step
// streams every weight once, and with 4 KiB pages the TLB misses cost ~20 % of the bandwidth
// (measured: a 9 MB Q4_0 weight read at 18 GB/s with 4 KiB pages, 23 GB/s with 2 MiB ones).
void advise_huge_pages(void* p, int64_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t HUGE = 2u << 20;
  const uintptr_t start = ((uintptr_t)p + HUGE - 1) & ~(HUGE - 1);
  const uintptr_t end = ((uintptr_t)p + (uintptr_t)n) & ~(HUGE - 1);
  if (end > start) madvise((void*)start, end - start, MADV_HUGEPAGE);
#else
  (void)p;
  (void)n;
#endif
}

// row-major GGUF blocks (N, row bytes) -> the interleaved layout (ceil(N / 8), group bytes)
at::Tensor repack(const at::Tensor& wt, int64_t type, int64_t k) {
  const Weight w = check_weight(wt, type, wt.size(0), k);
  TORCH_CHECK(kvq::has_x8(w.type), "GGUF type ", w.type, " has no interleaved layout");
  const kvq::TypeInfo ti = kvq::type_info(w.type);
  const int gb = kvq::x8_bytes(w.type);
  const int64_t nb = k / ti.block, groups = (w.n + kvq::X8 - 1) / kvq::X8;
  at::Tensor out = at::empty({groups, nb * gb}, wt.options());
  const uint8_t* src = wt.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  advise_huge_pages(dst, out.numel());
  at::parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> zero(ti.bytes, 0);
    for (int64_t g = b; g < e; g++)
      for (int64_t blk = 0; blk < nb; blk++) {
        const uint8_t* rows[kvq::X8];
        for (int r = 0; r < kvq::X8; r++) {
          const int64_t row = g * kvq::X8 + r;
          rows[r] = row < w.n ? src + row * w.row_bytes + blk * ti.bytes : zero.data();
        }
        kvq::repack_x8(w.type, dst + g * nb * gb + blk * gb, rows);
      }
  });
  return out;
}

// the row-major GGUF blocks (N, row bytes) back from the interleaved layout
at::Tensor unpack(const at::Tensor& wt, int64_t type, int64_t n, int64_t k) {
  const Weight w = check_weight(wt, type | kvq::X8_FLAG, n, k);
  const kvq::TypeInfo ti = kvq::type_info(w.type);
  const int64_t row_bytes = k / ti.block * ti.bytes;
  at::Tensor out = at::empty({n, row_bytes}, wt.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; r++) row_blocks(w, r, dst + r * row_bytes);
  });
  return out;
}

// x (M, K) quantized as the products quantize it: kind 0 -> (q8 codes, fp16-rounded scales,
// q8_1's rounded d * sum) per block of 32; kind 1 -> (codes, float scales, sums per 16) per
// 256 (q8_K). For tests against llama.cpp's rounding.
std::vector<at::Tensor> quantize_act(const at::Tensor& x, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), blk = kind == 0 ? 32 : 256;
  TORCH_CHECK(k % blk == 0, "K = ", k, " is not a multiple of ", blk);
  const ActBuffers buf(x.data_ptr<float>(), m, k, kind == 0, kind != 0, current());
  auto from = [](const auto& v, at::IntArrayRef shape, at::ScalarType t) {
    at::Tensor out = at::empty(shape, at::TensorOptions().dtype(t));
    std::memcpy(out.data_ptr(), v.data(), v.size() * sizeof(v[0]));
    return out;
  };
  if (kind == 0)
    return {from(buf.q32, {m, k}, at::kChar), from(buf.d32, {m, k / 32}, at::kFloat),
            from(buf.s32, {m, k / 32}, at::kFloat)};
  return {from(buf.qK, {m, k}, at::kChar), from(buf.dK, {m, k / 256}, at::kFloat),
          from(buf.bsK, {m, k / 16}, at::kShort)};
}

// ---------------------------------------------------------- the rest of a decode step
void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name,
              " must be a float32 CPU tensor");
}

// y = RMSNorm(x) * w per row: x (M, D) contiguous, w (D,)
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1),
              "rmsnorm: contiguous x (..., D) and w (D,)");
  const int64_t d = x.size(-1), m = x.numel() / std::max<int64_t>(1, d);
  at::Tensor y = at::empty_like(x);
  const Table* t = current();
  for (int64_t r = 0; r < m; r++)
    t->rmsnorm(x.data_ptr<float>() + r * d, w.data_ptr<float>(), (float)eps,
               y.data_ptr<float>() + r * d, d);
  return y;
}

// RoPE: x (B, H, T, D) with any strides but a contiguous last dimension; cos, ssin (C, T, D)
// contiguous with C = 1 (shared positions) or B (each row its own)
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& ssin) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(ssin, "ssin");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x (B, H, T, D), last dimension contiguous");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 3 &&
                  cos.sizes() == ssin.sizes() && cos.size(1) == T && cos.size(2) == D &&
                  (cos.size(0) == 1 || cos.size(0) == B),
              "rope: cos and ssin (1 or B, T, D)");
  at::Tensor y = at::empty({B, H, T, D}, x.options());
  const Table* t = current();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < T; i++) {
        const int64_t row = ((cos.size(0) == 1 ? 0 : b) * T + i) * D;
        t->rope(xp + b * x.stride(0) + h * x.stride(1) + i * x.stride(2),
                cos.data_ptr<float>() + row, ssin.data_ptr<float>() + row,
                yp + ((b * H + h) * T + i) * D, D);
      }
  return y;
}

// gu (M, 2N) contiguous: silu(gu[:, :N]) * gu[:, N:] -> (M, N)
at::Tensor silu_mul(const at::Tensor& gu) {
  check_f32(gu, "gate_up");
  TORCH_CHECK(gu.is_contiguous() && gu.size(-1) % 2 == 0, "silu_mul: contiguous (..., 2N)");
  const int64_t n2 = gu.size(-1), n = n2 / 2, m = gu.numel() / std::max<int64_t>(1, n2);
  auto shape = gu.sizes().vec();
  shape.back() = n;
  at::Tensor y = at::empty(shape, gu.options());
  const Table* t = current();
  for (int64_t r = 0; r < m; r++)
    t->silu_mul(gu.data_ptr<float>() + r * n2, gu.data_ptr<float>() + r * n2 + n,
                y.data_ptr<float>() + r * n, n);
  return y;
}

// Attention of R query rows per KV head over t keys that `chunk` reads a range of at a time,
// whatever form the store keeps them in: the keys are split into chunks over torch's threads
// (flash-decoding) and the chunks merged exactly. Every store's native attention is a `chunk`
// over this one driver.
//
// chunk(h, j0, n, part, mx, sm, scratch) fills, for KV head h's R rows over keys [j0, j0 + n):
// part (R, d) the value rows weighted by exp(score - mx), mx (R) the largest score (-inf where
// no key is visible), sm (R) the sum of those weights; scratch: the calling thread's, resized
// as the chunk needs. out (hkv * R, d): the attention output; lse (hkv * R) or nullptr: each
// row's log-sum-exp of its scores (-inf where it sees no key, its out row then 0).
// `min_chunk`: the fewest keys a task is worth (a store whose keys are groups passes a multiple
// of its group).
template <class Chunk>
void split_keys(int64_t hkv, int64_t R, int64_t t, int64_t d, int64_t min_chunk,
                const Chunk& chunk, float* out, float* lse) {
  for (int64_t i = 0; i < hkv * R * d; i++) out[i] = 0.f;
  if (lse != nullptr)
    for (int64_t i = 0; i < hkv * R; i++) lse[i] = -INFINITY;
  if (t == 0) return;
  const int64_t threads = at::get_num_threads();
  // chunks of keys: enough tasks for the threads, each long enough to pay for itself
  int64_t chunk_len = (hkv * t + 4 * threads - 1) / (4 * threads);
  chunk_len = std::min<int64_t>(std::max<int64_t>(chunk_len, min_chunk), t);
  chunk_len = (chunk_len + min_chunk - 1) / min_chunk * min_chunk;
  const int64_t nc = (t + chunk_len - 1) / chunk_len, tasks = hkv * nc;
  std::vector<float> part(tasks * R * d), mx(tasks * R), sm(tasks * R);
  dynamic_for(tasks, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scratch;
    for (int64_t task = b0; task < e0; task++) {
      const int64_t c = task % nc, h = task / nc;
      const int64_t j0 = c * chunk_len, n = std::min(chunk_len, t - j0);
      chunk(h, j0, n, part.data() + task * R * d, mx.data() + task * R, sm.data() + task * R,
            scratch);
    }
  });
  for (int64_t h = 0; h < hkv; h++)
    for (int64_t j = 0; j < R; j++) {
      float m = -INFINITY;
      for (int64_t c = 0; c < nc; c++) m = std::max(m, mx[(h * nc + c) * R + j]);
      if (m == -INFINITY) continue;  // no key visible: out 0, lse -inf
      float total = 0.f;
      float* o = out + (h * R + j) * d;
      for (int64_t c = 0; c < nc; c++) {
        const float mc = mx[(h * nc + c) * R + j];
        if (mc == -INFINITY) continue;
        const float w = std::exp(mc - m);
        total += w * sm[(h * nc + c) * R + j];
        const float* pp = part.data() + ((h * nc + c) * R + j) * d;
        for (int64_t i = 0; i < d; i++) o[i] += w * pp[i];
      }
      for (int64_t i = 0; i < d; i++) o[i] /= total;
      if (lse != nullptr) lse[h * R + j] = m + std::log(total);
    }
}

// Attention of one query row per head for one sequence: q (Hq, D) contiguous (post-RoPE); key j
// of KV head h at k + h * khs + j * kts (values alike); GQA: query head i reads KV head
// i / (Hq / Hkv). out (Hq, D). With Tq rows per head (q (Hq, Tq, D)), pass g * Tq as the rows
// of a KV head: every row sees every key.
void attend_rows(const float* q, int64_t hq, int64_t d, const float* k, int64_t khs, int64_t kts,
                 const float* v, int64_t vhs, int64_t vts, int64_t hkv, int64_t t, float scale,
                 float* out, const Table* tab, int64_t tq = 1, float* lse = nullptr) {
  const int64_t R = hq / hkv * tq;
  split_keys(
      hkv, R, t, d, 256,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        scratch.resize(R * n);
        tab->attn_chunk(q + h * R * d, (int)R, k + h * khs + j0 * kts, kts, v + h * vhs + j0 * vts,
                        vts, n, d, scale, part, mx, sm, scratch.data());
      },
      out, lse);
}

// q (B, Hq, 1, D); k, v (B, Hkv, T, D) with contiguous rows (a cache buffer's view) -> (B, Hq, 1, D)
at::Tensor attn_decode(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                       double scale) {
  check_f32(q_, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(q_.dim() == 4 && q_.size(2) == 1 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  k.stride(3) == 1 && v.stride(3) == 1 && k.size(0) == q_.size(0) &&
                  k.size(3) == q_.size(3) && q_.size(1) % k.size(1) == 0,
              "attn_decode: q (B, Hq, 1, D), k and v (B, Hkv, T, D) with contiguous rows");
  const at::Tensor q = q_.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  at::Tensor out = at::empty({B, Hq, 1, D}, q.options());
  for (int64_t b = 0; b < B; b++)
    attend_rows(q.data_ptr<float>() + b * Hq * D, Hq, D, k.data_ptr<float>() + b * k.stride(0),
                k.stride(1), k.stride(2), v.data_ptr<float>() + b * v.stride(0), v.stride(1),
                v.stride(2), Hkv, T, (float)scale, out.data_ptr<float>() + b * Hq * D, current());
  return out;
}

// q (1, Hq, Tq, D) attending every one of T keys, k and v (1, Hkv, T, D) float32 with
// contiguous rows -> [out (1, Hq, Tq, D), lse (1, Hq, Tq)]: one segment's Partial
// (kvrun.kv.attention), for a store that keeps its keys in float32.
std::vector<at::Tensor> attn_partial(const at::Tensor& q_, const at::Tensor& k,
                                     const at::Tensor& v, double scale) {
  check_f32(q_, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  k.size(0) == 1 && k.stride(3) == 1 && v.stride(3) == 1 &&
                  k.size(3) == q_.size(3) && q_.size(1) % k.size(1) == 0,
              "attn_partial: q (1, Hq, Tq, D), k and v (1, Hkv, T, D) with contiguous rows");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  at::Tensor out = at::empty({1, Hq, Tq, D}, q.options());
  at::Tensor lse = at::empty({1, Hq, Tq}, q.options());
  attend_rows(q.data_ptr<float>(), Hq, D, k.data_ptr<float>(), k.stride(1), k.stride(2),
              v.data_ptr<float>(), v.stride(1), v.stride(2), Hkv, T, (float)scale,
              out.data_ptr<float>(), current(), Tq, lse.data_ptr<float>());
  return {out, lse};
}

// One decode row of a plain dense cache: q, k (1, H, 1, D) rotated by RoPE (row pos of the
// cos, ssin tables (>= pos + 1, D)),
// k and v (1, Hkv, 1, D) written to slot n of the buffers kbuf, vbuf (1, Hkv, cap, D), then q
// attends over slots 0..n -> (1, Hq, 1, D). The same row functions as `rope` and `attn_decode`.
at::Tensor rope_append_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cos, const at::Tensor& ssin, int64_t pos,
                              at::Tensor& kbuf, at::Tensor& vbuf, int64_t n, double scale) {
  for (const at::Tensor* t : {&q, &k, &v, &cos, &ssin, static_cast<const at::Tensor*>(&kbuf),
                              static_cast<const at::Tensor*>(&vbuf)})
    check_f32(*t, "tensors");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && k.dim() == 4 && k.size(0) == 1 &&
                  k.size(2) == 1 && k.sizes() == v.sizes() && k.size(3) == d && hq % hkv == 0 &&
                  q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "rope_append_attend: q (1, Hq, 1, D), k and v (1, Hkv, 1, D)");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() && kbuf.size(1) == hkv &&
                  kbuf.size(3) == d && kbuf.is_contiguous() && vbuf.is_contiguous() && n >= 0 &&
                  n < kbuf.size(2),
              "rope_append_attend: buffers (1, Hkv, cap, D) with room for slot n");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == ssin.sizes() && cos.size(1) == d && pos >= 0 && pos < cos.size(0),
              "rope_append_attend: cos and ssin tables (>= pos + 1, D)");
  const Table* t = current();
  const int64_t cap = kbuf.size(2);
  std::vector<float> qr(hq * d);
  const float *cp = cos.data_ptr<float>() + pos * d, *sp = ssin.data_ptr<float>() + pos * d;
  for (int64_t h = 0; h < hq; h++)
    t->rope(q.data_ptr<float>() + h * q.stride(1), cp, sp, qr.data() + h * d, d);
  float* kb = kbuf.data_ptr<float>();
  float* vb = vbuf.data_ptr<float>();
  for (int64_t h = 0; h < hkv; h++) {
    t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, kb + (h * cap + n) * d, d);
    std::memcpy(vb + (h * cap + n) * d, v.data_ptr<float>() + h * v.stride(1), d * sizeof(float));
  }
  at::Tensor out = at::empty({1, hq, 1, d}, q.options());
  attend_rows(qr.data(), hq, d, kb, cap * d, d, vb, cap * d, d, hkv, n + 1, (float)scale,
              out.data_ptr<float>(), t);
  return out;
}

// ------------------------------------- attention that keeps its probabilities (tova_attn.h)
// For the methods that score keys by the attention they draw: one pass computes the output and
// the probabilities (TOVA's step scores, H2O's and MiniKV's column sums, KVzip's maxima).

void check_rows(const at::Tensor& k, const at::Tensor& v, const char* op) {
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1 && k.stride(3) == 1 &&
                  v.stride(3) == 1,
              op, ": k and v (1, Hkv, T, D) with contiguous rows");
}

// One decode row per head (q (Hq, D) contiguous) over t keys: key j of KV head h at
// k + h * khs + j * kts (values alike) -> out (Hq, D) and p (Hq, t), the probabilities the row
// attended with: the raw scores kept per chunk, made exact once the merge gives each row's
// log-sum-exp. acc (rows of stride as), where given, gets p added: each KV head's group summed
// (Hkv rows) or per query head (Hq rows).
void attend_probs_rows(const float* q, int64_t hq, int64_t d, const float* k, int64_t khs,
                       int64_t kts, const float* v, int64_t vhs, int64_t vts, int64_t hkv,
                       int64_t t, float scale, float* out, float* p, float* acc, int64_t acc_rows,
                       int64_t as, const Table* tab) {
  const int64_t g = hq / hkv;
  std::vector<float> lse(hq);
  split_keys(
      hkv, g, t, d, 256,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        scratch.resize(g * n);
        tab->attn_chunk_scores(q + h * g * d, (int)g, k + h * khs + j0 * kts, kts,
                               v + h * vhs + j0 * vts, vts, n, d, scale, part, mx, sm,
                               scratch.data(), p + h * g * t + j0, t);
      },
      out, lse.data());
  for (int64_t r = 0; r < hq; r++) tab->probs_row(p + r * t, t, lse[r]);
  if (acc != nullptr)
    for (int64_t r = 0; r < hq; r++)
      tab->fold_row(p + r * t, t, 1.f, 0, acc + (acc_rows == hq ? r : r / g) * as);
}

void check_acc(const at::Tensor& a, int64_t hq, int64_t hkv, int64_t t, const char* op) {
  check_f32(a, "acc");
  TORCH_CHECK(a.dim() == 2 && a.size(1) == t && a.stride(1) == 1 &&
                  (a.size(0) == hkv || a.size(0) == hq),
              op, ": acc (Hkv or Hq, T) with contiguous rows");
}

// One decode row per head: q (1, Hq, 1, D) over every key of k, v (1, Hkv, T, D) ->
// [out (1, Hq, 1, D), p (Hq, T)] (attend_probs_rows); acc (Hkv or Hq, T), where given, gets p
// added in place.
std::vector<at::Tensor> attn_probs(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                                   double scale, const c10::optional<at::Tensor>& acc) {
  check_f32(q_, "q");
  check_rows(k, v, "attn_probs");
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && q_.size(2) == 1 && k.size(3) == q_.size(3) &&
                  q_.size(1) % k.size(1) == 0,
              "attn_probs: q (1, Hq, 1, D)");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  at::Tensor out = at::empty({1, Hq, 1, D}, q.options());
  at::Tensor p = at::empty({Hq, T}, q.options());
  if (acc.has_value()) check_acc(*acc, Hq, Hkv, T, "attn_probs");
  attend_probs_rows(q.data_ptr<float>(), Hq, D, k.data_ptr<float>(), k.stride(1), k.stride(2),
                    v.data_ptr<float>(), v.stride(1), v.stride(2), Hkv, T, (float)scale,
                    out.data_ptr<float>(), p.data_ptr<float>(),
                    acc.has_value() ? acc->data_ptr<float>() : nullptr,
                    acc.has_value() ? acc->size(0) : 0, acc.has_value() ? acc->stride(0) : 0,
                    current());
  return {out, p};
}

// rope_append_attend for a cache that scores its slots by the step's attention (TOVA, H2O):
// q, k rotated (row pos of cos, ssin), k and v written to slot n of kbuf, vbuf, q attending
// over slots 0..n with its probabilities -> [out (1, Hq, 1, D), p (Hq, n + 1), q rotated
// (1, Hq, 1, D), kpos (R, n + 1) int32 with pos appended (empty without kpos), acc
// (A, n + 1) with the new slot's 0 appended, then p added (empty without acc)].
std::vector<at::Tensor> rope_append_probs(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& cos,
                                          const at::Tensor& ssin, int64_t pos, at::Tensor& kbuf,
                                          at::Tensor& vbuf, int64_t n, double scale,
                                          const c10::optional<at::Tensor>& kpos,
                                          const c10::optional<at::Tensor>& acc) {
  for (const at::Tensor* t : {&q, &k, &v, &cos, &ssin, static_cast<const at::Tensor*>(&kbuf),
                              static_cast<const at::Tensor*>(&vbuf)})
    check_f32(*t, "tensors");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && k.dim() == 4 && k.size(0) == 1 &&
                  k.size(2) == 1 && k.sizes() == v.sizes() && k.size(3) == d && hq % hkv == 0 &&
                  q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "rope_append_probs: q (1, Hq, 1, D), k and v (1, Hkv, 1, D)");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() && kbuf.size(1) == hkv &&
                  kbuf.size(3) == d && kbuf.is_contiguous() && vbuf.is_contiguous() && n >= 0 &&
                  n < kbuf.size(2),
              "rope_append_probs: buffers (1, Hkv, cap, D) with room for slot n");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == ssin.sizes() && cos.size(1) == d && pos >= 0 && pos < cos.size(0),
              "rope_append_probs: cos and ssin tables (>= pos + 1, D)");
  const Table* t = current();
  const int64_t cap = kbuf.size(2);
  at::Tensor qr = at::empty({1, hq, 1, d}, q.options());
  float* qp = qr.data_ptr<float>();
  const float *cp = cos.data_ptr<float>() + pos * d, *sp = ssin.data_ptr<float>() + pos * d;
  for (int64_t h = 0; h < hq; h++) t->rope(q.data_ptr<float>() + h * q.stride(1), cp, sp, qp + h * d, d);
  float* kb = kbuf.data_ptr<float>();
  float* vb = vbuf.data_ptr<float>();
  for (int64_t h = 0; h < hkv; h++) {
    t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, kb + (h * cap + n) * d, d);
    std::memcpy(vb + (h * cap + n) * d, v.data_ptr<float>() + h * v.stride(1), d * sizeof(float));
  }
  at::Tensor kp_new, acc_new;
  if (kpos.has_value()) {
    const at::Tensor& kp = *kpos;
    TORCH_CHECK(kp.scalar_type() == at::kInt && kp.dim() == 2 && kp.size(1) == n &&
                    kp.stride(1) == 1,
                "rope_append_probs: kpos (R, n) int32 with contiguous rows");
    kp_new = at::empty({kp.size(0), n + 1}, kp.options());
    for (int64_t r = 0; r < kp.size(0); r++) {
      int32_t* dst = kp_new.data_ptr<int32_t>() + r * (n + 1);
      std::memcpy(dst, kp.data_ptr<int32_t>() + r * kp.stride(0), n * sizeof(int32_t));
      dst[n] = (int32_t)pos;
    }
  } else {
    kp_new = at::empty({0}, q.options().dtype(at::kInt));
  }
  if (acc.has_value()) {
    check_acc(*acc, hq, hkv, n, "rope_append_probs");
    const int64_t rows = acc->size(0);
    acc_new = at::empty({rows, n + 1}, q.options());
    for (int64_t r = 0; r < rows; r++) {
      float* dst = acc_new.data_ptr<float>() + r * (n + 1);
      std::memcpy(dst, acc->data_ptr<float>() + r * acc->stride(0), n * sizeof(float));
      dst[n] = 0.f;
    }
  } else {
    acc_new = at::empty({0}, q.options());
  }
  at::Tensor out = at::empty({1, hq, 1, d}, q.options());
  at::Tensor p = at::empty({hq, n + 1}, q.options());
  attend_probs_rows(qp, hq, d, kb, cap * d, d, vb, cap * d, d, hkv, n + 1, (float)scale,
                    out.data_ptr<float>(), p.data_ptr<float>(),
                    acc.has_value() ? acc_new.data_ptr<float>() : nullptr,
                    acc.has_value() ? acc_new.size(0) : 0, n + 1, t);
  return {out, p, qr, kp_new, acc_new};
}

// A prefill chunk's attention with each key's probabilities folded over query rows and heads:
// q (1, Hq, Tq, D) over k, v (1, Hkv, T, D) (v absent: no output) -> [out (1, Hq, Tq, D),
// lse (1, Hq, Tq), col (Hkv, T), or (Hq, T) per_head]. Visibility: without kpos, causal by
// slot (the queries are the last Tq slots), or every key (causal false); with kpos (1 or Hkv, T) int32 and qpos (Tq,)
// int64, key j is seen from query i when kpos[j] <= qpos[i] and, window > 0, within it.
// other (Hq, Tq), where given: the log-sum-exp of keys held elsewhere, so the column sums are
// of the softmax over those too (out and lse cover these keys only: a Partial). mode 0 sums
// the probabilities, mode 1 takes their maximum, mode 2 gives no col (attention alone, causal
// or by position, with its lse). Each KV head's query rows go in blocks,
// every block holding all its scores so its softmax is exact in one pass; the blocks' column
// partials are folded in a fixed order (the sums do not depend on the threads).
std::vector<at::Tensor> attn_colsum(const at::Tensor& q_, const at::Tensor& k,
                                    const c10::optional<at::Tensor>& v_, double scale,
                                    const c10::optional<at::Tensor>& kpos_,
                                    const c10::optional<at::Tensor>& qpos_, int64_t window,
                                    const c10::optional<at::Tensor>& other_, bool per_head,
                                    int64_t mode, bool causal) {
  check_f32(q_, "q");
  check_rows(k, v_.has_value() ? *v_ : k, "attn_colsum");
  const at::Tensor q = q_.contiguous();
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.size(3) == q.size(3) &&
                  q.size(1) % k.size(1) == 0 && mode >= 0 && mode <= 2,
              "attn_colsum: q (1, Hq, Tq, D), mode 0, 1 or 2");
  const int64_t Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  const int64_t g = Hq / Hkv, ncr = per_head ? g : 1;
  at::Tensor kpos, qpos, other;
  if (kpos_.has_value()) {
    kpos = kpos_->contiguous();
    TORCH_CHECK(qpos_.has_value() && kpos.scalar_type() == at::kInt && kpos.dim() == 2 &&
                    kpos.size(1) == T && (kpos.size(0) == 1 || kpos.size(0) == Hkv),
                "attn_colsum: kpos (1 or Hkv, T) int32 with qpos");
    qpos = qpos_->to(at::kLong).contiguous();
    TORCH_CHECK(qpos.numel() == Tq, "attn_colsum: qpos (Tq,)");
  } else {
    TORCH_CHECK(Tq <= T || !causal, "attn_colsum: the queries are the last Tq of the T slots");
  }
  if (other_.has_value()) {
    other = other_->to(at::kFloat).contiguous();
    TORCH_CHECK(other.numel() == Hq * Tq, "attn_colsum: other (Hq, Tq)");
  }
  at::Tensor out = at::zeros({1, Hq, Tq, D}, q.options());
  at::Tensor lse = at::empty({1, Hq, Tq}, q.options());
  at::Tensor col = at::zeros({mode == 2 ? 0 : Hkv * ncr, T}, q.options());
  if (Tq == 0 || T == 0) {
    lse.fill_(-INFINITY);
    return {out, lse, col};
  }
  const Table* tab = current();
  const int64_t rb = std::max<int64_t>(1, 24 / g);  // query rows a block: ~24 rows of scores
  const int64_t qb = std::max<int64_t>(rb * 4, (Tq + 31) / 32 / rb * rb + rb);  // rows a task
  const int64_t nb = (Tq + qb - 1) / qb, tasks = Hkv * nb;
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>();
  const float* vd = v_.has_value() ? v_->data_ptr<float>() : nullptr;
  const int64_t vhs = v_.has_value() ? v_->stride(1) : 0, vts = v_.has_value() ? v_->stride(2) : 0;
  const int32_t* kp = kpos.defined() ? kpos.data_ptr<int32_t>() : nullptr;
  const int64_t* qp = qpos.defined() ? qpos.data_ptr<int64_t>() : nullptr;
  const float* od = other.defined() ? other.data_ptr<float>() : nullptr;
  float *outd = out.data_ptr<float>(), *lsed = lse.data_ptr<float>();
  // K packed once for the broadcast product, where the instruction set has one (AVX-512)
  const bool packed = tab->pack_kt != nullptr && D % 16 == 0;
  const int64_t tpad = (T + 63) / 64 * 64;
  std::vector<float> kt(packed ? Hkv * tpad * D : 0);
  if (packed)
    dynamic_for(Hkv, 1, [&](int64_t b0, int64_t e0) {
      for (int64_t h = b0; h < e0; h++)
        tab->pack_kt(kd + h * k.stride(1), k.stride(2), T, D, kt.data() + h * tpad * D);
    });
  const bool cols = mode != 2;
  std::vector<float> part(cols ? tasks * ncr * T : 0);
  std::vector<int64_t> hi_of(tasks, 0);
  // the keys rows [i0, i1) can see: a prefix of the slots (by slot, or up to the last key
  // whose position the last row reaches)
  auto reach = [&](int64_t h, int64_t i1) -> int64_t {
    if (kp == nullptr) return causal ? T - Tq + i1 : T;
    const int32_t* kr = kp + (kpos.size(0) == 1 ? 0 : h) * T;
    int64_t qmax = qp[0];
    for (int64_t i = 0; i < i1; i++) qmax = std::max(qmax, qp[i]);
    int64_t hi = T;
    while (hi > 0 && kr[hi - 1] > qmax) hi--;
    return hi;
  };
  dynamic_for(tasks, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> qbuf, obuf, lbuf, s;
    std::vector<int64_t> lim;
    for (int64_t task = b0; task < e0; task++) {
      const int64_t h = task % Hkv, blk = nb - 1 - task / Hkv;  // the longest rows first
      const int64_t i0 = blk * qb, i1 = std::min(Tq, i0 + qb);
      const int64_t hi_task = reach(h, i1);
      hi_of[task] = hi_task;
      float* pt = cols ? part.data() + task * ncr * T : nullptr;
      for (int64_t c = 0; cols && c < ncr; c++) std::fill(pt + c * T, pt + c * T + hi_task, 0.f);
      const int32_t* kr = kp == nullptr ? nullptr : kp + (kpos.size(0) == 1 ? 0 : h) * T;
      for (int64_t s0 = i0; s0 < i1; s0 += rb) {
        const int64_t m = std::min(rb, i1 - s0), R = g * m;
        const int64_t hi = std::min(hi_task, reach(h, s0 + m));
        qbuf.resize(R * D);
        obuf.resize(R * D);
        lbuf.resize(R);
        lim.resize(R);
        const int64_t ls = (hi + 15) / 16 * 16;  // room for whole groups of 16 (pack_kt)
        s.resize(cols ? R * std::max<int64_t>(ls, 1) : 0);
        for (int64_t a = 0; a < g; a++)
          for (int64_t i = 0; i < m; i++) {
            const int64_t r = a * m + i, row = (h * g + a) * Tq + s0 + i;
            std::memcpy(qbuf.data() + r * D, qd + row * D, D * sizeof(float));
            lim[r] = kp == nullptr ? (causal ? T - Tq + s0 + i + 1 : T) : qp[s0 + i];
          }
        tab->attn_rows_probs(qbuf.data(), (int)R, D, kd + h * k.stride(1), k.stride(2),
                             packed ? kt.data() + h * tpad * D : nullptr,
                             vd ? vd + h * vhs : nullptr, vts, hi, (float)scale, kr, lim.data(),
                             window, obuf.data(), lbuf.data(), cols ? s.data() : nullptr, ls);
        for (int64_t a = 0; a < g; a++)
          for (int64_t i = 0; i < m; i++) {
            const int64_t r = a * m + i, row = (h * g + a) * Tq + s0 + i;
            if (vd) std::memcpy(outd + row * D, obuf.data() + r * D, D * sizeof(float));
            lsed[row] = lbuf[r];
            if (!cols) continue;
            float w = 1.f;  // this segment's share of the row's softmax over every segment
            if (od != nullptr && od[row] != -INFINITY)
              w = lbuf[r] == -INFINITY ? 0.f : 1.f / (1.f + std::exp(od[row] - lbuf[r]));
            tab->fold_row(s.data() + r * ls, hi, w, (int)mode, pt + (per_head ? a : 0) * T);
          }
      }
    }
  });
  if (!cols) return {out, lse, col};
  // the blocks' partials, folded in block order per (row of col, stretch of keys)
  float* cd = col.data_ptr<float>();
  constexpr int64_t STRETCH = 2048;
  const int64_t ns = (T + STRETCH - 1) / STRETCH;
  dynamic_for(Hkv * ncr * ns, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t w = b0; w < e0; w++) {
      const int64_t rowc = w / ns, j0 = (w % ns) * STRETCH, j1 = std::min(T, j0 + STRETCH);
      const int64_t h = rowc / ncr, c = rowc % ncr;
      float* y = cd + rowc * T;
      for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t task = (nb - 1 - blk) * Hkv + h;
        const int64_t e = std::min(j1, hi_of[task]);
        if (e > j0) tab->fold_row(part.data() + (task * ncr + c) * T + j0, e - j0, 1.f, (int)mode, y + j0);
      }
    }
  });
  return {out, lse, col};
}

// One slot out per row of scores, written over by the last slot (no compaction): scores
// (H, C) of the first C of the n occupied slots (the rest rank as +inf), pos (H, >= n) int32
// their positions. Ranking as kvrun.kv.cache.keep_indices ranks in position order: the
// `first` lowest and `last` highest positions of a row are protected (+inf), then the score,
// ties to the lower position; the slot ranked last leaves. H = 1: one slot for every KV head.
// K, V (kbuf, vbuf (1, Hkv, cap, D), contiguous), pos and acc (Hkv * r rows, >= n) move their
// last slot into it. Returns the slots evicted (H,); the caller drops the last slot.
at::Tensor evict_one(const at::Tensor& scores_, at::Tensor& pos, int64_t first, int64_t last,
                     at::Tensor& kbuf, at::Tensor& vbuf, int64_t n,
                     const c10::optional<at::Tensor>& acc) {
  const at::Tensor scores = scores_.contiguous();
  check_f32(scores, "scores");
  check_f32(kbuf, "kbuf");
  check_f32(vbuf, "vbuf");
  const int64_t H = scores.size(0), C = scores.size(1), Hkv = kbuf.size(1), D = kbuf.size(3);
  TORCH_CHECK(scores.dim() == 2 && pos.dim() == 2 && pos.scalar_type() == at::kInt &&
                  pos.size(0) == H && pos.size(1) >= n && pos.stride(1) == 1 && C <= n && n > 0 &&
                  (H == 1 || H == Hkv),
              "evict_one: scores (1 or Hkv, C <= n), pos (the same rows, >= n) int32");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() && kbuf.is_contiguous() &&
                  vbuf.is_contiguous() && kbuf.size(2) >= n,
              "evict_one: kbuf, vbuf (1, Hkv, cap >= n, D) contiguous");
  at::Tensor victims = at::empty({H}, pos.options().dtype(at::kLong));
  const float* sp = scores.data_ptr<float>();
  int32_t* pp = pos.data_ptr<int32_t>();
  std::vector<int32_t> tmp(n);
  for (int64_t r = 0; r < H; r++) {
    const int32_t* pr = pp + r * pos.stride(0);
    // the first-lowest and last-highest positions of the row (positions are distinct)
    int64_t lo = INT64_MIN, hi = INT64_MAX;
    if (first > 0) {
      std::copy(pr, pr + n, tmp.begin());
      const int64_t f = std::min(first, n) - 1;
      std::nth_element(tmp.begin(), tmp.begin() + f, tmp.end());
      lo = tmp[f];
    }
    if (last > 0) {
      std::copy(pr, pr + n, tmp.begin());
      const int64_t f = n - std::min(last, n);
      std::nth_element(tmp.begin(), tmp.begin() + f, tmp.end());
      hi = tmp[f];
    }
    int64_t best = -1;
    float bs = 0.f;
    for (int64_t j = 0; j < n; j++) {
      const bool inf = j >= C || pr[j] <= lo || pr[j] >= hi;
      const float s = inf ? INFINITY : sp[r * C + j];
      if (best < 0 || s < bs || (s == bs && pr[j] > pr[best])) {
        best = j;
        bs = s;
      }
    }
    victims[r] = best;
  }
  const int64_t* vic = victims.data_ptr<int64_t>();
  const int64_t L = n - 1, cap = kbuf.size(2);
  float *kb = kbuf.data_ptr<float>(), *vb = vbuf.data_ptr<float>();
  for (int64_t h = 0; h < Hkv; h++) {
    const int64_t j = vic[H == 1 ? 0 : h];
    if (j == L) continue;
    std::memcpy(kb + (h * cap + j) * D, kb + (h * cap + L) * D, D * sizeof(float));
    std::memcpy(vb + (h * cap + j) * D, vb + (h * cap + L) * D, D * sizeof(float));
  }
  for (int64_t r = 0; r < H; r++)
    pp[r * pos.stride(0) + vic[r]] = pp[r * pos.stride(0) + L];
  if (acc.has_value()) {
    at::Tensor a = *acc;
    check_f32(a, "acc");
    TORCH_CHECK(a.dim() == 2 && a.size(1) >= n && a.stride(1) == 1 && a.size(0) % Hkv == 0,
                "evict_one: acc (Hkv * r, >= n)");
    float* ap = a.data_ptr<float>();
    const int64_t per = a.size(0) / Hkv;
    for (int64_t row = 0; row < a.size(0); row++) {
      const int64_t j = vic[H == 1 ? 0 : row / per];
      ap[row * a.stride(0) + j] = ap[row * a.stride(0) + L];
    }
  }
  return victims;
}

// ----------------------------------------------------- a decoder layer's decode step, fused
// The arithmetic of kvrun.model.Block for decode rows, op for op (the same row functions and
// products, so the modules and the fused loop agree bit for bit), in two calls a layer.

void rmsnorm_rows(const float* x, const float* w, double eps, float* y, int64_t m, int64_t d,
                  const Table* t) {
  for (int64_t r = 0; r < m; r++) t->rmsnorm(x + r * d, w, (float)eps, y + r * d, d);
}

// q, k, v (B, H, 1, Dh) views of qkv_proj(rmsnorm(x)) for x (B, D): before attention
std::vector<at::Tensor> attn_in(const at::Tensor& x, const at::Tensor& norm, double eps,
                                at::TensorList ws, at::IntArrayRef codes, at::IntArrayRef rows,
                                int64_t hq, int64_t hkv) {
  check_x(x);
  check_f32(norm, "norm");
  const Table* t = current();
  const int64_t m = x.size(0), d = x.size(1);
  const Call call(ws, codes, rows, d, t);
  TORCH_CHECK(call.n() % (hq + 2 * hkv) == 0, "attn_in: Q, K, V rows do not split into heads");
  std::vector<float> h(m * d);
  rmsnorm_rows(x.data_ptr<float>(), norm.data_ptr<float>(), eps, h.data(), m, d, t);
  at::Tensor y = at::empty({m, call.n()}, x.options());
  call.run(h.data(), m, d, y.data_ptr<float>(), t);
  const int64_t dh = call.n() / (hq + 2 * hkv);
  at::Tensor heads = y.view({m, 1, hq + 2 * hkv, dh}).transpose(1, 2);  // (B, H, 1, Dh)
  return {heads.narrow(1, 0, hq), heads.narrow(1, hq, hkv), heads.narrow(1, hq + hkv, hkv)};
}

// x + down(silu_mul(gate_up(rmsnorm(x + o(attn))))) + o(attn) for x (B, D), attn (B, Hq, 1, Dh):
// everything after attention
at::Tensor attn_out(const at::Tensor& x, const at::Tensor& attn, at::TensorList ow,
                    at::IntArrayRef oc, at::IntArrayRef orows, const at::Tensor& norm,
                    double eps, at::TensorList gw, at::IntArrayRef gc, at::IntArrayRef grows,
                    at::TensorList dw, at::IntArrayRef dc, at::IntArrayRef drows) {
  check_x(x);
  check_f32(norm, "norm");
  const at::Tensor a = attn.contiguous();
  check_f32(a, "attn");
  const Table* t = current();
  const int64_t m = x.size(0), d = x.size(1), ad = a.numel() / std::max<int64_t>(1, m);
  TORCH_CHECK(a.numel() == m * ad, "attn_out: attention rows do not match x");
  const Call o(ow, oc, orows, ad, t), gu(gw, gc, grows, d, t);
  TORCH_CHECK(o.n() == d && gu.n() % 2 == 0, "attn_out: O and gate/up shapes");
  const int64_t ffn = gu.n() / 2;
  const Call down(dw, dc, drows, ffn, t);
  TORCH_CHECK(down.n() == d, "attn_out: down shape");
  at::Tensor out = at::empty({m, d}, x.options());
  float* xo = out.data_ptr<float>();
  const float* xi = x.data_ptr<float>();
  std::vector<float> tmp(m * std::max(d, gu.n())), h(m * d), act(m * ffn);
  o.run(a.data_ptr<float>(), m, ad, tmp.data(), t);
  for (int64_t i = 0; i < m * d; i++) xo[i] = xi[i] + tmp[i];
  rmsnorm_rows(xo, norm.data_ptr<float>(), eps, h.data(), m, d, t);
  gu.run(h.data(), m, d, tmp.data(), t);
  for (int64_t r = 0; r < m; r++)
    t->silu_mul(tmp.data() + r * 2 * ffn, tmp.data() + r * 2 * ffn + ffn, act.data() + r * ffn, ffn);
  down.run(act.data(), m, ffn, tmp.data(), t);
  for (int64_t i = 0; i < m * d; i++) xo[i] += tmp[i];
  return out;
}

// The output head's top logits made exact: for each row r of y (R, N) = x (R, K) @ W^T from the
// fast products, the logits within `margin` of the row's largest (at most `most` of them, the
// largest) are recomputed from W's exact dequantized rows (the dot product summed in double).
void refine_top(at::Tensor& y, const at::Tensor& x, const at::Tensor& wt, int64_t code, int64_t n,
                int64_t k, double margin, int64_t most) {
  check_x(x);
  check_f32(y, "y");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == n &&
                  x.size(1) == k,
              "refine_top: y (R, N), x (R, K)");
  const Weight w = check_weight(wt, code, n, k);
  const kvq::DequantFn fn = current()->dequant[w.type];
  TORCH_CHECK(fn != nullptr, "GGUF type ", w.type, " has no native dequantization");
  const kvq::TypeInfo ti = kvq::type_info(w.type);
  std::vector<uint8_t> blocks(k / ti.block * ti.bytes);
  std::vector<float> row(k);
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < y.size(0); r++) {
    float* yr = yp + r * n;
    const float* xr = xp + r * k;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = yr[j] > m ? yr[j] : m;
    const float floor = m - (float)margin;
    std::vector<std::pair<float, int64_t>> top;
    for (int64_t j = 0; j < n; j++)
      if (yr[j] > floor) top.emplace_back(yr[j], j);
    if ((int64_t)top.size() > most) {
      std::partial_sort(top.begin(), top.begin() + most, top.end(),
                        [](const auto& a, const auto& b) { return a.first > b.first; });
      top.resize(most);
    }
    for (const auto& [_, j] : top) {
      const uint8_t* src = w.t->data_ptr<uint8_t>() + j * w.row_bytes;
      if (w.x8) {
        row_blocks(w, j, blocks.data());
        src = blocks.data();
      }
      fn(src, k, row.data());
      double acc = 0.0;
      for (int64_t i = 0; i < k; i++) acc += (double)row[i] * (double)xr[i];
      yr[j] = (float)acc;
    }
  }
}

bool has_dequant(int64_t type) {
  return type >= 0 && type < kvq::NTYPES && current()->dequant[type] != nullptr;
}

bool has_x8(int64_t type) { return type >= 0 && type < kvq::NTYPES && kvq::has_x8((int)type); }

// How many of torch's threads take part in one of our parallel regions (dynamic_for's): the
// build's check that at::parallel_for here runs on torch's pool and not on the calling thread
// alone (which it silently does when this file is compiled without OpenMP).
int64_t threads_used() {
  const int64_t n = at::get_num_threads();
  std::vector<int> seen(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::accumulate(seen.begin(), seen.end(), int64_t{0});
}

}  // namespace

TORCH_LIBRARY(kvrun_cpu, m) {
  m.def("qmm(Tensor x, Tensor[] ws, int[] codes, int[] rows) -> Tensor", &qmm);
  m.def("dequant(Tensor w, int code, int n, int k, Tensor? idx=None, Tensor? out=None) -> Tensor",
        &dequant);
  m.def("repack(Tensor w, int type, int k) -> Tensor", &repack);
  m.def("unpack(Tensor w, int type, int n, int k) -> Tensor", &unpack);
  m.def("has_x8(int type) -> bool", &has_x8);
  m.def("quantize_act(Tensor x, int kind) -> Tensor[]", &quantize_act);
  m.def(
      "refine_top(Tensor(a!) y, Tensor x, Tensor w, int code, int n, int k, float margin, "
      "int most) -> ()",
      &refine_top);
  m.def("rmsnorm(Tensor x, Tensor w, float eps) -> Tensor", &rmsnorm);
  m.def("rope(Tensor x, Tensor cos, Tensor ssin) -> Tensor", &rope);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
  m.def("attn_decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &attn_decode);
  m.def("attn_partial(Tensor q, Tensor k, Tensor v, float scale) -> Tensor[]", &attn_partial);
  // attention that keeps its probabilities (tova_attn.h)
  m.def("attn_probs(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!)? acc=None) -> Tensor[]",
        &attn_probs);
  m.def(
      "rope_append_probs(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor(a!) kbuf, Tensor(b!) vbuf, int n, float scale, Tensor? kpos=None, Tensor? acc=None) "
      "-> Tensor[]",
      &rope_append_probs);
  m.def(
      "attn_colsum(Tensor q, Tensor k, Tensor? v, float scale, Tensor? kpos=None, "
      "Tensor? qpos=None, int window=0, Tensor? other=None, bool per_head=False, int mode=0, "
      "bool causal=True) -> Tensor[]",
      &attn_colsum);
  m.def(
      "evict_one(Tensor scores, Tensor(a!) pos, int first, int last, Tensor(b!) kbuf, "
      "Tensor(c!) vbuf, int n, Tensor(d!)? acc=None) -> Tensor",
      &evict_one);
  m.def(
      "rope_append_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor(a!) kbuf, Tensor(b!) vbuf, int n, float scale) -> Tensor",
      &rope_append_attend);
  m.def(
      "attn_in(Tensor x, Tensor norm, float eps, Tensor[] ws, int[] codes, int[] rows, int hq, "
      "int hkv) -> Tensor[]",
      &attn_in);
  m.def(
      "attn_out(Tensor x, Tensor attn, Tensor[] ow, int[] oc, int[] orows, Tensor norm, "
      "float eps, Tensor[] gw, int[] gc, int[] grows, Tensor[] dw, int[] dc, int[] drows) -> "
      "Tensor",
      &attn_out);
  m.def("isa() -> str", &isa);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("has_gemm(int type) -> bool", &has_gemm);
  m.def("has_dequant(int type) -> bool", &has_dequant);
  m.def("threads_used() -> int", &threads_used);
}
