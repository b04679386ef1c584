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
//   attn_typed: the same over K/V rows in a KV type (f32, f16, bf16, q8_0, q4_0: kvrows.h)
//   kv_encode, kv_decode: float32 rows <-> a KV type's rows, as llama.cpp's caches store them
//   merged_attn: (out, lse) over a MiniCache pair's layer, E read once per key, the per-key
//                factor on scores and weights, retained rows in place, the step's own tokens
//   codebook_attn: (out, lse) over SpindleKV's slots, codebook rows gathered, keys rotated at
//                their positions, a keep mask per query head
//   codebook_assign: SpindleKV's decode tokens into the codebooks (join the best row, or add)
//   codebook_build: SpindleKV's prefill codebook (the greedy medoid cover) over its graph
//   kivi_pack, kivi_attn, kivi_rope_append_attend, kivi_dequant: the KIVI store's flush (bit
//                                 for bit kivi_pack_ref), one layer's attention over its packed
//                                 body and dense tail (out, lse), a decode row rotated, stored
//                                 and attended in one call, a range of the body dequantized
//                                 (kivi_ops.h)
//   kivi_merged_attn: a minicache+kivi4 pair layer's decode row (rotated here, or not) over
//                 its E in the KIVI store, restored in the products (n / ||E|| on scores and
//                 weights, retained rows)
//   codebook_step: a SpindleKV decode token coded, stored as a slot and attended, in one call
//   minicache_merge: MiniCache's SLERP merge of two layers' rows (direction, norms, angle)
//   minicache_merge_into: a decode token's merge written into a pair's buffers (K and V)
//   rope_merged_attn: a MiniCache pair layer's decode row (rotate, attend) in one call
//   minicache_step: the same on the pair's buffers as kept, the later layer's merge after it
//   attn_in, attn_out: a decoder layer's decode step before and after attention, fused
//   rope_append_attend: a plain dense cache's decode row (rotate, store, attend) in one call
//   attn_probs: a decode row's attention (out) and the probabilities it used (p), optionally
//                 added to accumulated scores (H2O) (tova_attn.h); K/V in any KV type
//   rope_append_probs: rope_append_attend that also gives those probabilities (and appends
//                 the new slot's position and accumulated score)
//   attn_colsum: a prefill chunk's causal attention and each key's probability summed (or the
//                 maximum) over the rows and heads (H2O, MiniKV, KVzip)
//   evict_one: one slot out per KV head (or layer) by scores and position rank, the last slot
//                 written over it (TOVA / H2O at their budget: no compaction); rows of any type
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
#include <ATen/ops/mm.h>
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
#include <queue>
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
constexpr int64_t SERIAL_BYTES = 4 << 20;  // Call::run: smaller products on one thread

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
    int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile_bytes));
    // one row through small weights (under SERIAL_BYTES at ~4 bits a weight) stays on the
    // calling thread: a decode row's weights stream at near one core's bandwidth (a 2-core
    // EPYC: ~35 of the pair's ~62 GB/s) and a parallel region costs more than the second core
    // saves there (bench/NOTES.md, 2026-12-07). Several rows (a prefill chunk, a batch) as before
    if (m == 1 && tile_start.back() * tile_bytes < SERIAL_BYTES) grain = tile_start.back();
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
// of its group). `extra` more tasks, other work of the same call, run in the same parallel
// region after the chunks (run_extra(i), i < extra), where they fill the threads' last gaps.
struct NoExtra {
  void operator()(int64_t) const {}
};
template <class Chunk, class Extra = NoExtra>
void split_keys(int64_t hkv, int64_t R, int64_t t, int64_t d, int64_t min_chunk,
                const Chunk& chunk, float* out, float* lse, int64_t extra = 0,
                const Extra& run_extra = Extra()) {
  for (int64_t i = 0; i < hkv * R * d; i++) out[i] = 0.f;
  if (lse != nullptr)
    for (int64_t i = 0; i < hkv * R; i++) lse[i] = -INFINITY;
  if (t == 0 && extra == 0) return;
  const int64_t threads = at::get_num_threads();
  // chunks of keys: enough tasks for the threads, each long enough to pay for itself
  int64_t chunk_len = (hkv * t + 4 * threads - 1) / (4 * threads);
  chunk_len = std::min<int64_t>(std::max<int64_t>(chunk_len, min_chunk), t);
  chunk_len = (chunk_len + min_chunk - 1) / min_chunk * min_chunk;
  const int64_t nc = t == 0 ? 0 : (t + chunk_len - 1) / chunk_len, tasks = hkv * nc;
  std::vector<float> part(tasks * R * d), mx(tasks * R), sm(tasks * R);
  dynamic_for(tasks + extra, 1, [&](int64_t b0, int64_t e0) {
    std::vector<float> scratch;
    for (int64_t task = b0; task < e0; task++) {
      if (task >= tasks) {
        run_extra(task - tasks);
        continue;
      }
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

// ----------------------------------------------------- dense K/V in a KV type (kvrows.h)
constexpr int64_t KV_TILE = 64;  // keys converted at a time: a K and a V tile stay in L1 at D = 64

// The chunk's running (part, mx, sm) of R rows and a later tile's (p2, mx2, sm2), merged exactly.
void merge_tile(int64_t R, int64_t d, float* part, float* mx, float* sm, const float* p2,
                const float* mx2, const float* sm2) {
  for (int64_t r = 0; r < R; r++) {
    const float m = std::max(mx[r], mx2[r]);
    if (m == -INFINITY) continue;
    const float a = std::exp(mx[r] - m), b = std::exp(mx2[r] - m);
    float* o = part + r * d;
    const float* o2 = p2 + r * d;
    for (int64_t i = 0; i < d; i++) o[i] = o[i] * a + o2[i] * b;
    sm[r] = sm[r] * a + sm2[r] * b;
    mx[r] = m;
  }
}

// The keys [0, n) of one KV head's chunk held in a KV type (row i at k + i * kts bytes, values
// alike), a tile of KV_TILE at a time converted to float32 in the thread's scratch and attended
// by `tile(kt, vt, m, a, part, mx, sm, sc)` (tile a..a+m as contiguous rows, sc scratch for R *
// m scores); later tiles merge into the first's (part, mx, sm) exactly. Only the stored bytes
// stream from memory.
template <class Tile>
void typed_tiles(kvq::DequantFn load, const uint8_t* k, int64_t kts, const uint8_t* v,
                 int64_t vts, int64_t n, int64_t R, int64_t d, float* part, float* mx, float* sm,
                 std::vector<float>& scratch, Tile&& tile) {
  scratch.resize(2 * KV_TILE * d + R * KV_TILE + R * d + 2 * R);
  float *kt = scratch.data(), *vt = kt + KV_TILE * d, *sc = vt + KV_TILE * d;
  float *p2 = sc + R * KV_TILE, *mx2 = p2 + R * d, *sm2 = mx2 + R;
  for (int64_t a = 0; a < n; a += KV_TILE) {
    const int64_t m = std::min(KV_TILE, n - a);
    for (int64_t i = 0; i < m; i++) {
      load(k + (a + i) * kts, d, kt + i * d);
      load(v + (a + i) * vts, d, vt + i * d);
    }
    if (a == 0) {
      tile(kt, vt, m, a, part, mx, sm, sc);
    } else {
      tile(kt, vt, m, a, p2, mx2, sm2, sc);
      merge_tile(R, d, part, mx, sm, p2, mx2, sm2);
    }
  }
}

// `attend_rows` over K/V rows of KV type `type`: row j of KV head h at k + h * khs + j * kts
// bytes (values alike), read through `typed_tiles`.
void attend_typed(const float* q, int64_t hq, int64_t d, const uint8_t* k, int64_t khs,
                  int64_t kts, const uint8_t* v, int64_t vhs, int64_t vts, int type, int64_t hkv,
                  int64_t t, float scale, float* out, const Table* tab, int64_t tq, float* lse) {
  if (type == kvq::KV_F32) {
    attend_rows(q, hq, d, reinterpret_cast<const float*>(k), khs / 4, kts / 4,
                reinterpret_cast<const float*>(v), vhs / 4, vts / 4, hkv, t, scale, out, tab, tq,
                lse);
    return;
  }
  const int64_t R = hq / hkv * tq;
  if (type == kvq::KV_F16) {  // converted in the loads: no tile to write and read back
    const uint16_t *k16 = reinterpret_cast<const uint16_t*>(k),
                   *v16 = reinterpret_cast<const uint16_t*>(v);
    split_keys(
        hkv, R, t, d, 256,
        [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
            std::vector<float>& scratch) {
          scratch.resize(R * n);
          tab->attn_chunk_f16(q + h * R * d, (int)R, k16 + (h * khs + j0 * kts) / 2, kts / 2,
                              v16 + (h * vhs + j0 * vts) / 2, vts / 2, n, d, scale, part, mx,
                              sm, scratch.data());
        },
        out, lse);
    return;
  }
  split_keys(
      hkv, R, t, d, KV_TILE,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        typed_tiles(tab->kv_load[type], k + h * khs + j0 * kts, kts, v + h * vhs + j0 * vts, vts,
                    n, R, d, part, mx, sm, scratch,
                    [&](const float* kt, const float* vt, int64_t m, int64_t, float* o, float* x,
                        float* s, float* sc) {
                      tab->attn_chunk(q + h * R * d, (int)R, kt, d, vt, d, m, d, scale, o, x, s,
                                      sc);
                    });
      },
      out, lse);
}

// The KV type of a store's tensor: float32, float16 and bfloat16 by dtype; uint8 rows of
// blocks by `type` (q8_0 or q4_0), checked against head_dim d.
int kv_type_of(const at::Tensor& x, int64_t type, int64_t d) {
  const auto st = x.scalar_type();
  const int t = st == at::kFloat ? kvq::KV_F32
                : st == at::kHalf ? kvq::KV_F16
                : st == at::kBFloat16 ? kvq::KV_BF16
                : st == at::kByte ? (int)type
                                  : -1;
  TORCH_CHECK(t == kvq::KV_F32 || t == kvq::KV_F16 || t == kvq::KV_BF16 || t == kvq::KV_Q8_0 ||
                  t == kvq::KV_Q4_0,
              "KV rows must be float32, float16, bfloat16 or uint8 q8_0 / q4_0 blocks");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) * x.element_size() == kvq::kv_row_bytes(t, d) &&
                  x.stride(-1) == 1 && (t < 2 || t == kvq::KV_BF16 || d % 32 == 0),
              "KV rows of ", d, " values do not match the tensor's last dimension");
  return t;
}

// x (..., D) float32 -> the same rows in KV type `type` (1 f16, 30 bf16: their dtype; 8 q8_0,
// 2 q4_0: uint8 blocks (..., D / 32 * bytes))
at::Tensor kv_encode(const at::Tensor& x_, int64_t type) {
  check_f32(x_, "x");
  const at::Tensor x = x_.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(1, d);
  auto shape = x.sizes().vec();
  at::Tensor out;
  if (type == kvq::KV_F16 || type == kvq::KV_BF16) {
    out = at::empty(shape, x.options().dtype(type == kvq::KV_F16 ? at::kHalf : at::kBFloat16));
  } else {
    TORCH_CHECK((type == kvq::KV_Q8_0 || type == kvq::KV_Q4_0) && d % 32 == 0,
                "kv_encode: type 1 (f16), 30 (bf16), 8 (q8_0) or 2 (q4_0; D a multiple of 32)");
    shape.back() = kvq::kv_row_bytes((int)type, d);
    out = at::empty(shape, x.options().dtype(at::kByte));
  }
  const Table* tab = current();
  const int64_t rb = kvq::kv_row_bytes((int)type, d);
  uint8_t* o = static_cast<uint8_t*>(out.data_ptr());
  const float* xp = x.data_ptr<float>();
  dynamic_for(rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; r++) tab->kv_store[type](xp + r * d, d, o + r * rb);
  });
  return out;
}

// rows in a KV type (as kv_encode makes them; any strides outside the last dimension) ->
// float32 (..., d), contiguous
at::Tensor kv_decode(const at::Tensor& x, int64_t type, int64_t d) {
  const int t = kv_type_of(x, type, d);
  auto shape = x.sizes().vec();
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
  if (t == kvq::KV_F32) return out.copy_(x);
  const int64_t rows = out.numel() / std::max<int64_t>(1, d), nd = x.dim();
  const Table* tab = current();
  const uint8_t* base = static_cast<const uint8_t*>(x.data_ptr());
  float* o = out.data_ptr<float>();
  const int64_t es = x.element_size();
  dynamic_for(rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; r++) {
      int64_t off = 0, rest = r;  // the row's byte offset from its index over the outer dims
      for (int64_t i = nd - 2; i >= 0; i--) {
        off += (rest % x.size(i)) * x.stride(i) * es;
        rest /= x.size(i);
      }
      tab->kv_load[t](base + off, d, o + r * d);
    }
  });
  return out;
}

// q (1, Hq, Tq, D) float32 attending every one of T keys held in a KV type: k, v (1, Hkv, T, *)
// rows of one type (float32 / float16 / bfloat16 by dtype, or uint8 blocks of `type`) ->
// [out (1, Hq, Tq, D), lse (1, Hq, Tq)]
std::vector<at::Tensor> attn_typed(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                                   double scale, int64_t type) {
  check_f32(q_, "q");
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && k.dim() == 4 && k.sizes() == v.sizes() &&
                  k.scalar_type() == v.scalar_type() && k.size(0) == 1 &&
                  q_.size(1) % k.size(1) == 0,
              "attn_typed: q (1, Hq, Tq, D), k and v (1, Hkv, T, row)");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), Tq = q.size(2), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  const int t = kv_type_of(k, type, D);
  kv_type_of(v, type, D);
  const int64_t es = k.element_size();
  at::Tensor out = at::empty({1, Hq, Tq, D}, q.options());
  at::Tensor lse = at::empty({1, Hq, Tq}, q.options());
  attend_typed(q.data_ptr<float>(), Hq, D, static_cast<const uint8_t*>(k.data_ptr()),
               k.stride(1) * es, k.stride(2) * es, static_cast<const uint8_t*>(v.data_ptr()),
               v.stride(1) * es, v.stride(2) * es, t, Hkv, T, (float)scale,
               out.data_ptr<float>(), current(), Tq, lse.data_ptr<float>());
  return {out, lse};
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

// ------------------------------------ MiniCache's merged pairs, SpindleKV's codebook slots
// (merged_attn.h's chunks over split_keys, and the codebook search of a decode token)

using OptT = c10::optional<at::Tensor>;

int row_elem(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
              name, " must be a float32 or float16 CPU tensor");
  return t.scalar_type() == at::kHalf ? kvq::EL_F16 : kvq::EL_F32;
}

// Keys k_j, v_j (d floats at k + j * ks, v + j * vs) folded exactly into a chunk's (part, mx,
// sm) of R rows: the step's own tokens jf.. jf + n - 1 of tn, row r (query r % tq of tq)
// seeing token j where j <= r % tq + tn - tq (causal among themselves).
void fold_own(const float* q, int64_t R, int64_t d, int64_t tq, int64_t tn, const float* k,
              int64_t ks, const float* v, int64_t vs, int64_t jf, int64_t n, float scale,
              float* part, float* mx, float* sm) {
  for (int64_t j = jf; j < jf + n; j++)
    for (int64_t r = 0; r < R; r++) {
      if (j > r % tq + tn - tq) continue;
      const float* kj = k + j * ks;
      float s = 0.f;
      for (int64_t i = 0; i < d; i++) s += q[r * d + i] * kj[i];
      s *= scale;
      const float m = std::max(mx[r], s);
      const float old = std::exp(mx[r] - m), w = std::exp(s - m);  // exp(-inf) = 0
      float* o = part + r * d;
      for (int64_t i = 0; i < d; i++) o[i] = o[i] * old + w * v[j * vs + i];
      sm[r] = sm[r] * old + w;
      mx[r] = m;
    }
}

// One half of a pair (E, factors, retained rows) checked against (Hkv, T, D) and filled in.
kvq::MergedHalf merged_half(const at::Tensor& e, const at::Tensor& s, const OptT& ridx,
                            const OptT& roff, const OptT& rows, int64_t r_grp, int elem) {
  const int64_t H = e.size(0), T = e.size(1), D = e.size(2);
  TORCH_CHECK(row_elem(e, "E") == elem && e.dim() == 3 && e.stride(2) == 1,
              "merged_attn: E (Hkv, T, D) with contiguous rows, E_K and E_V of one dtype");
  check_f32(s, "factors");
  TORCH_CHECK(s.dim() == 2 && s.size(0) == H && s.size(1) == T, "merged_attn: factors (Hkv, T)");
  kvq::MergedHalf m{e.data_ptr(), e.stride(0), e.stride(1), s.data_ptr<float>(), s.stride(0),
                    s.stride(1), nullptr, nullptr, nullptr, 0, 0, r_grp};
  if (!ridx.has_value()) {
    TORCH_CHECK(!roff.has_value() && !rows.has_value(), "merged_attn: retained rows without ridx");
    return m;
  }
  TORCH_CHECK(roff.has_value() && rows.has_value(), "merged_attn: ridx without roff and rows");
  const int64_t groups = r_grp ? H : 1, width = r_grp ? D : H * D;
  TORCH_CHECK(ridx->scalar_type() == at::kInt && ridx->dim() == 1 && ridx->is_contiguous() &&
                  roff->scalar_type() == at::kLong && roff->dim() == 1 &&
                  roff->is_contiguous() && roff->size(0) == groups + 1,
              "merged_attn: ridx (N,) int32 and roff (groups + 1,) int64, contiguous");
  TORCH_CHECK(row_elem(*rows, "rows") == elem && rows->dim() == 2 &&
                  rows->size(0) == ridx->size(0) && rows->size(1) == width && rows->stride(1) == 1,
              "merged_attn: retained rows (N, ", width, ") in E's dtype");
  const int32_t* ix = ridx->data_ptr<int32_t>();
  const int64_t* off = roff->data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[groups] == ridx->size(0), "merged_attn: roff does not span ridx");
  for (int64_t g = 0; g < groups; g++) {
    TORCH_CHECK(off[g] <= off[g + 1], "merged_attn: roff not ascending");
    for (int64_t r = off[g]; r < off[g + 1]; r++)
      TORCH_CHECK(ix[r] >= 0 && ix[r] < T && (r == off[g] || ix[r - 1] < ix[r]),
                  "merged_attn: retained indices must ascend within [0, T) per group");
  }
  m.ridx = ix;
  m.roff = off;
  m.rows = rows->data_ptr();
  m.r_row = rows->stride(0);
  m.r_col = r_grp ? 0 : D;
  return m;
}

// Attention of q (1, Hq, Tq, D) over a MiniCache pair's layer: token j of KV head h is
// E[h, j] * s[h, j] (/ ||E[h, j]|| with unit) or its retained exact row, then the step's own
// exact k_new, v_new (1, Hkv, Tn, D), causal among themselves -> [out (1, Hq, Tq, D), lse
// (1, Hq, Tq)]. r_grp 1: retained rows per KV head (N, D); 0: per token (N, Hkv * D).
std::vector<at::Tensor> merged_attn(const at::Tensor& q_, const at::Tensor& e_k,
                                    const at::Tensor& s_k, const at::Tensor& e_v,
                                    const at::Tensor& s_v, bool unit, const OptT& ridx_k,
                                    const OptT& roff_k, const OptT& rows_k, const OptT& ridx_v,
                                    const OptT& roff_v, const OptT& rows_v, int64_t r_grp,
                                    const OptT& k_new, const OptT& v_new, double scale) {
  check_f32(q_, "q");
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && e_k.dim() == 3 && e_k.sizes() == e_v.sizes() &&
                  e_k.size(2) == q_.size(3) && e_k.size(0) > 0 && q_.size(1) % e_k.size(0) == 0,
              "merged_attn: q (1, Hq, Tq, D), E_K and E_V (Hkv, T, D)");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), Tq = q.size(2), D = q.size(3), H = e_k.size(0), T = e_k.size(1);
  const int64_t R = Hq / H * Tq;
  const int elem = row_elem(e_k, "E_K");
  kvq::MergedArgs a{q.data_ptr<float>(), R, D, (float)scale, elem, unit ? 1 : 0,
                    merged_half(e_k, s_k, ridx_k, roff_k, rows_k, r_grp, elem),
                    merged_half(e_v, s_v, ridx_v, roff_v, rows_v, r_grp, elem)};
  int64_t Tn = 0;
  const float *kn = nullptr, *vn = nullptr;
  int64_t kn_h = 0, kn_t = 0, vn_h = 0, vn_t = 0;
  if (k_new.has_value()) {
    TORCH_CHECK(v_new.has_value(), "merged_attn: k_new without v_new");
    check_f32(*k_new, "k_new");
    check_f32(*v_new, "v_new");
    TORCH_CHECK(k_new->dim() == 4 && k_new->sizes() == v_new->sizes() && k_new->size(0) == 1 &&
                    k_new->size(1) == H && k_new->size(3) == D && k_new->stride(3) == 1 &&
                    v_new->stride(3) == 1 && k_new->size(2) <= Tq,
                "merged_attn: k_new, v_new (1, Hkv, Tn <= Tq, D) with contiguous rows");
    Tn = k_new->size(2);
    kn = k_new->data_ptr<float>();
    vn = v_new->data_ptr<float>();
    kn_h = k_new->stride(1), kn_t = k_new->stride(2), vn_h = v_new->stride(1), vn_t = v_new->stride(2);
  }
  at::Tensor out = at::empty({1, Hq, Tq, D}, q.options());
  at::Tensor lse = at::empty({1, Hq, Tq}, q.options());
  const Table* tab = current();
  split_keys(
      H, R, T + Tn, D, 64,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        const int64_t nm = std::max<int64_t>(0, std::min(j0 + n, T) - j0);
        if (nm > 0) {
          scratch.resize(R * nm);
          tab->merged_chunk(a, h, j0, nm, part, mx, sm, scratch.data());
        } else {
          std::fill(part, part + R * D, 0.f);
          std::fill(mx, mx + R, -INFINITY);
          std::fill(sm, sm + R, 0.f);
        }
        const int64_t first = std::max(j0, T);
        if (j0 + n > first)
          fold_own(a.q + h * R * D, R, D, Tq, Tn, kn + h * kn_h, kn_t, vn + h * vn_h, vn_t,
                   first - T, j0 + n - first, a.scale, part, mx, sm);
      },
      out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// A decode row's q (1, Hq, 1, D), k, v (1, Hkv, 1, D) float32 with contiguous rows, and RoPE
// tables cos, ssin (>= pos + 1, D) (rope_store's and rope_merged_attn's checks)
void check_rope_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cos, const at::Tensor& ssin, int64_t pos, const char* op) {
  for (const at::Tensor* x : {&q, &k, &v, &cos, &ssin}) check_f32(*x, "tensors");
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && k.dim() == 4 && k.size(0) == 1 &&
                  k.size(2) == 1 && k.sizes() == v.sizes() && k.size(3) == d && hq % hkv == 0 &&
                  q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              op, ": q (1, Hq, 1, D), k and v (1, Hkv, 1, D)");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == ssin.sizes() && cos.size(1) == d && pos >= 0 && pos < cos.size(0),
              op, ": cos and ssin tables (>= pos + 1, D)");
}

// every head of a decode row x (1, H, 1, D) rotated by the table rows cp, sp into y (H, D)
void rope_heads(const at::Tensor& x, const float* cp, const float* sp, float* y, const Table* t) {
  const int64_t d = x.size(3);
  for (int64_t h = 0; h < x.size(1); h++)
    t->rope(x.data_ptr<float>() + h * x.stride(1), cp, sp, y + h * d, d);
}

// A decode row of a MiniCache pair's layer in one call: q (1, Hq, 1, D) and k (1, Hkv, 1, D)
// rotated by RoPE (row pos of the cos, ssin tables (>= pos + 1, D), as `rope`), then
// merged_attn over the merged tokens (whole factors) and the step's own k, v -> [out
// (1, Hq, 1, D), k rotated (1, Hkv, 1, D): what the pair merges once both layers ran].
std::vector<at::Tensor> rope_merged_attn(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& cos,
                                         const at::Tensor& ssin, int64_t pos,
                                         const at::Tensor& e_k, const at::Tensor& s_k,
                                         const at::Tensor& e_v, const at::Tensor& s_v,
                                         const OptT& ridx_k, const OptT& roff_k,
                                         const OptT& rows_k, const OptT& ridx_v,
                                         const OptT& roff_v, const OptT& rows_v, int64_t r_grp,
                                         double scale) {
  check_rope_row(q, k, v, cos, ssin, pos, "rope_merged_attn");
  const int64_t d = q.size(3);
  const Table* t = current();
  at::Tensor qr = at::empty({1, q.size(1), 1, d}, q.options());
  at::Tensor kr = at::empty({1, k.size(1), 1, d}, q.options());
  const float *cp = cos.data_ptr<float>() + pos * d, *sp = ssin.data_ptr<float>() + pos * d;
  rope_heads(q, cp, sp, qr.data_ptr<float>(), t);
  rope_heads(k, cp, sp, kr.data_ptr<float>(), t);
  std::vector<at::Tensor> r = merged_attn(qr, e_k, s_k, e_v, s_v, false, ridx_k, roff_k, rows_k,
                                          ridx_v, roff_v, rows_v, r_grp, kr, v, scale);
  return {r[0], kr};
}

at::Tensor minicache_merge_into(at::TensorList xa_, at::TensorList xb_, int64_t g, double t,
                                double sin_eps, at::TensorList e, at::TensorList na,
                                at::TensorList nb, at::TensorList fa, at::TensorList fb,
                                int64_t n);

// A MiniCache pair layer's decode row on the pair's buffers as they are kept (room along the
// token axis, n merged tokens held), in one call: q and k rotated (as rope_merged_attn), q
// attending over the n merged tokens with this layer's factors and the row's own k, v; at the
// pair's later layer (ka, va given: the earlier layer's rotated k and its v) the token's rows of
// both layers are then merged into slot n (minicache_merge_into's arithmetic; the caller has
// made room and advances the buffers after). bufs: E_K, E_V (Hkv, cap, D); the norms na_K, na_V,
// nb_K, nb_V and the factors fa_K, fa_V, fb_K, fb_V (g, cap), factors float32; g is Hkv (a
// group per head) or 1 (one per token, shared by the heads). -> [out (1, Hq, 1, D), k rotated]
std::vector<at::Tensor> minicache_step(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& cos,
                                       const at::Tensor& ssin, int64_t pos, at::TensorList bufs,
                                       int64_t n, bool second, const OptT& ka, const OptT& va,
                                       const OptT& ridx_k, const OptT& roff_k, const OptT& rows_k,
                                       const OptT& ridx_v, const OptT& roff_v, const OptT& rows_v,
                                       int64_t r_grp, int64_t g, double t, double sin_eps,
                                       double scale) {
  TORCH_CHECK(bufs.size() == 10, "minicache_step: E, norms and factors of K and V (10 buffers)");
  const at::Tensor &ek = bufs[0], &ev = bufs[1];
  TORCH_CHECK(ek.dim() == 3 && ek.sizes() == ev.sizes() && n >= 0 && n <= ek.size(1) &&
                  ek.size(0) > 0 && (g == ek.size(0) || g == 1),
              "minicache_step: E_K, E_V (Hkv, cap >= n, D), g Hkv or 1");
  const int64_t H = ek.size(0);
  at::Tensor fk = bufs[second ? 8 : 6], fv = bufs[second ? 9 : 7];
  TORCH_CHECK(fk.dim() == 2 && fv.dim() == 2 && fk.size(0) == g && fv.size(0) == g &&
                  fk.size(1) >= n && fv.size(1) >= n,
              "minicache_step: factors (g, cap >= n)");
  fk = fk.narrow(1, 0, n).expand({H, n});
  fv = fv.narrow(1, 0, n).expand({H, n});
  std::vector<at::Tensor> r =
      rope_merged_attn(q, k, v, cos, ssin, pos, ek.narrow(1, 0, n), fk, ev.narrow(1, 0, n), fv,
                       ridx_k, roff_k, rows_k, ridx_v, roff_v, rows_v, r_grp, scale);
  const at::Tensor& kr = r[1];
  if (second) {
    TORCH_CHECK(ka.has_value() && va.has_value(), "minicache_step: layer a's k and v at layer b");
    minicache_merge_into({*ka, *va}, {kr, v}, g, t, sin_eps, {bufs[0], bufs[1]},
                         {bufs[2], bufs[3]}, {bufs[4], bufs[5]}, {bufs[6], bufs[7]},
                         {bufs[8], bufs[9]}, n);
  }
  return r;
}

// The smallest and largest of n integers x[0], x[st], ... (n > 0; one pass the compiler
// vectorizes where st is 1: the slots' bounds are checked every decode step)
template <typename I>
std::pair<int64_t, int64_t> row_range(const I* x, int64_t n, int64_t st) {
  I lo = n ? x[0] : 0, hi = lo;
  if (st == 1) {
    for (int64_t s = 0; s < n; s++) {
      lo = x[s] < lo ? x[s] : lo;
      hi = x[s] > hi ? x[s] : hi;
    }
  } else {
    for (int64_t s = 0; s < n; s++) {
      lo = x[s * st] < lo ? x[s * st] : lo;
      hi = x[s * st] > hi ? x[s * st] : hi;
    }
  }
  return {(int64_t)lo, (int64_t)hi};
}

// One side (K or V) of SpindleKV's slots: coded (idx and mag given, book (N, D)) or dense
// (book (Hkv, S, D)).
kvq::BookSide book_side(const at::Tensor& book, const OptT& idx, const OptT& mag, const OptT& off,
                        int64_t H, int64_t S, int64_t D, int elem) {
  TORCH_CHECK(row_elem(book, "book") == elem && book.stride(-1) == 1,
              "codebook_attn: books of one dtype with contiguous rows");
  kvq::BookSide b{book.data_ptr(), 0, 0, nullptr, 0, 0, 0, nullptr, 0, 0, 0, nullptr};
  TORCH_CHECK(idx.has_value() == mag.has_value(), "codebook_attn: idx and mag go together");
  if (!idx.has_value()) {
    TORCH_CHECK(book.dim() == 3 && book.size(0) == H && book.size(1) >= S && book.size(2) == D &&
                    !off.has_value(),
                "codebook_attn: dense slots (Hkv, S, D)");
    b.b_h = book.stride(0), b.b_r = book.stride(1);
    return b;
  }
  TORCH_CHECK(book.dim() == 2 && book.size(1) == D, "codebook_attn: a book (N, D)");
  const auto it = idx->scalar_type();
  TORCH_CHECK(idx->dim() == 2 && idx->size(0) == H && idx->size(1) >= S &&
                  (it == at::kShort || it == at::kInt || it == at::kLong),
              "codebook_attn: idx (Hkv, S) int16, int32 or int64");
  b.mag_elem = row_elem(*mag, "mag");
  TORCH_CHECK(mag->dim() == 2 && mag->size(0) == H && mag->size(1) >= S, "codebook_attn: mag (Hkv, S)");
  b.b_r = book.stride(0);
  b.idx = idx->data_ptr();
  b.idx_bytes = (int)idx->element_size();
  b.i_h = idx->stride(0), b.i_s = idx->stride(1);
  b.mag = mag->data_ptr();
  b.m_h = mag->stride(0), b.m_s = mag->stride(1);
  if (off.has_value()) {
    TORCH_CHECK(off->scalar_type() == at::kInt && off->dim() == 1 && off->size(0) == H &&
                    off->is_contiguous(),
                "codebook_attn: off (Hkv,) int32");
    b.off = off->data_ptr<int32_t>();
  }
  const int64_t rows = book.size(0);  // every slot's row inside the book: each head's extremes
  for (int64_t h = 0; h < H; h++) {
    const auto [lo, hi] = b.idx_bytes == 2   ? row_range(static_cast<const int16_t*>(b.idx) + h * b.i_h, S, b.i_s)
                          : b.idx_bytes == 4 ? row_range(static_cast<const int32_t*>(b.idx) + h * b.i_h, S, b.i_s)
                                             : row_range(static_cast<const int64_t*>(b.idx) + h * b.i_h, S, b.i_s);
    const int64_t o = b.off != nullptr ? b.off[h] : 0;
    TORCH_CHECK(S == 0 || (lo >= 0 && hi < rows - o), "codebook_attn: slot row ",
                lo < 0 ? lo : hi, " (book offset ", o, ") outside the book's ", rows);
  }
  return b;
}

// codebook_attn's arguments checked and filled in (q contiguous, the caller's) for the first S
// slots of the buffers (-1: all of pos's).
kvq::CodebookArgs codebook_args(const at::Tensor& q, const at::Tensor& book_k, const OptT& idx_k,
                                const OptT& mag_k, const at::Tensor& book_v, const OptT& idx_v,
                                const OptT& mag_v, const at::Tensor& pos, const at::Tensor& cos,
                                const at::Tensor& sin, const OptT& mask, const OptT& off_k,
                                const OptT& off_v, double scale, int64_t S = -1) {
  check_f32(q, "q");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(3) % 2 == 0 && q.is_contiguous() &&
                  pos.dim() == 2 && pos.size(0) > 0 && q.size(1) % pos.size(0) == 0 &&
                  pos.scalar_type() == at::kInt,
              "codebook_attn: q (1, Hq, Tq, D), pos (Hkv, S) int32");
  const int64_t Hq = q.size(1), Tq = q.size(2), D = q.size(3), H = pos.size(0);
  if (S < 0) S = pos.size(1);
  TORCH_CHECK(S <= pos.size(1), "codebook_attn: pos (Hkv, S) int32");
  const int64_t g = Hq / H;
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.strides() == sin.strides() &&
                  cos.size(1) == D && cos.stride(1) == 1,
              "codebook_attn: cos, sin tables (P, D) alike");
  const int elem = row_elem(book_k, "book_k");
  kvq::CodebookArgs a{};
  a.q = q.data_ptr<float>(), a.R = g * Tq, a.d = D, a.tq = Tq, a.scale = (float)scale;
  a.elem = elem;
  a.k = book_side(book_k, idx_k, mag_k, off_k, H, S, D, elem);
  a.v = book_side(book_v, idx_v, mag_v, off_v, H, S, D, elem);
  a.pos = pos.data_ptr<int32_t>(), a.p_h = pos.stride(0), a.p_s = pos.stride(1);
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>(), a.cs_r = cos.stride(0);
  for (int64_t h = 0; h < H; h++) {
    const auto [lo, hi] = row_range(a.pos + h * a.p_h, S, a.p_s);
    TORCH_CHECK(S == 0 || (lo >= 0 && hi < cos.size(0)), "codebook_attn: position ",
                lo < 0 ? lo : hi, " outside the tables");
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kByte && mask->dim() == 3 && mask->size(0) == H &&
                    mask->size(1) >= S && mask->size(2) == (g + 7) / 8 && mask->stride(2) == 1,
                "codebook_attn: mask (Hkv, S, ceil(g / 8)) uint8");
    a.mask = mask->data_ptr<uint8_t>(), a.k_h = mask->stride(0), a.k_s = mask->stride(1);
  }
  return a;
}

// split_keys over the S slots of a: out (Hkv * R, d), lse; `extra` tasks of the caller's
// (codebook_step's search) in the same parallel region.
template <class Extra = NoExtra>
void codebook_split(const kvq::CodebookArgs& a, int64_t H, int64_t S, float* out, float* lse,
                    int64_t extra = 0, const Extra& run_extra = Extra()) {
  const Table* tab = current();
  split_keys(
      H, a.R, S, a.d, 64,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        scratch.resize(a.R * n);
        tab->codebook_chunk(a, h, j0, n, part, mx, sm, scratch.data());
      },
      out, lse, extra, run_extra);
}

// SpindleKV's decode attention (kernels/codebook_decode.py's arguments, and scale): q (1, Hq,
// Tq, D) post-RoPE over slots (Hkv, S): keys RoPE(book_k[off_k[h] + idx_k] * mag_k, pos),
// values book_v[off_v[h] + idx_v] * mag_v (dense slots: book (Hkv, S, D), idx and mag None);
// query head j of a group sees the slots with bit j of `mask` set (None: all) -> [out, lse].
std::vector<at::Tensor> codebook_attn(const at::Tensor& q_, const at::Tensor& book_k,
                                      const OptT& idx_k, const OptT& mag_k,
                                      const at::Tensor& book_v, const OptT& idx_v,
                                      const OptT& mag_v, const at::Tensor& pos,
                                      const at::Tensor& cos, const at::Tensor& sin,
                                      const OptT& mask, const OptT& off_k, const OptT& off_v,
                                      double scale) {
  check_f32(q_, "q");
  const at::Tensor q = q_.contiguous();
  const kvq::CodebookArgs a = codebook_args(q, book_k, idx_k, mag_k, book_v, idx_v, mag_v, pos,
                                            cos, sin, mask, off_k, off_v, scale);
  at::Tensor out = at::empty({1, q.size(1), q.size(2), q.size(3)}, q.options());
  at::Tensor lse = at::empty({1, q.size(1), q.size(2)}, q.options());
  codebook_split(a, pos.size(0), pos.size(1), out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// x (H, D) rows (stride xs) -> unit vectors u (H, D) (0 for a zero row) and norms mag (H)
void unit_rows(const float* x, int64_t xs, int64_t H, int64_t D, float* u, float* mag) {
  for (int64_t h = 0; h < H; h++) {
    const float* xr = x + h * xs;
    float ss = 0.f;
    for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
    mag[h] = std::sqrt(ss);
    const float div = mag[h] > 0.f ? mag[h] : 1.f;
    for (int64_t i = 0; i < D; i++) u[h * D + i] = xr[i] / div;
  }
}

// A shelf (n_books, cap, D) of `elem`: book b's rows from row b * cap.
struct Shelf {
  char* base;
  int elem;
  int64_t nb, cap, D;
  int64_t* cnt;  // rows used per book
  char* row(int64_t b, int64_t r) const {
    return base + (b * cap + r) * D * (elem == kvq::EL_F16 ? 2 : 4);
  }
};

// For every head, the first row with the largest u . row among the rows its book held before
// the call (exact where that exceeds `floor`, the only rows a join wants: best_rows may pass
// over rows that cannot): searched for every head of a book at once, in blocks (the first
// maximum of each block, then over the blocks in order: the first overall). The blocks are
// tasks for the caller's threads: scan_rows' own, or codebook_step's beside its attention.
struct RowScan {
  static constexpr int64_t BLOCK = 512;
  const float* u;
  const Shelf& sh;
  float floor;                // only rows above it wanted (theta; -inf: every row)
  int64_t per;                // heads searched a block (every head of a shared book, or one)
  std::vector<int64_t> first;  // each book's first block
  std::vector<float> bb;       // (blocks, per) each block's best dot products
  std::vector<int64_t> ba;     // and their rows

  RowScan(const float* u_, const Shelf& sh_, int64_t H, float floor_)
      : u(u_), sh(sh_), floor(floor_), per(sh_.nb == 1 ? H : 1), first(sh_.nb + 1, 0) {
    for (int64_t b = 0; b < sh.nb; b++) first[b + 1] = first[b] + (sh.cnt[b] + BLOCK - 1) / BLOCK;
    bb.assign(blocks() * per, -INFINITY);
    ba.assign(blocks() * per, 0);
  }
  int64_t blocks() const { return first[sh.nb]; }
  int64_t rows() const {
    int64_t n = 0;
    for (int64_t b = 0; b < sh.nb; b++) n += sh.cnt[b];
    return n;
  }
  void run(int64_t i, const Table* tab) {
    int64_t b = 0;
    while (i >= first[b + 1]) b++;
    const int64_t r0 = (i - first[b]) * BLOCK, m = std::min(BLOCK, sh.cnt[b] - r0);
    tab->best_rows(u + (sh.nb == 1 ? 0 : b) * sh.D, per, sh.row(b, r0), sh.elem, sh.D, m, sh.D,
                   floor, bb.data() + i * per, ba.data() + i * per);
    for (int64_t k = 0; k < per; k++) ba[i * per + k] += r0;
  }
  void merge(int64_t H, float* best, int64_t* arg) const {
    for (int64_t h = 0; h < H; h++) best[h] = -INFINITY, arg[h] = 0;
    for (int64_t b = 0; b < sh.nb; b++)
      for (int64_t i = first[b]; i < first[b + 1]; i++)
        for (int64_t k = 0; k < per; k++) {
          const int64_t h = (sh.nb == 1 ? 0 : b) + k;
          if (bb[i * per + k] > best[h]) {
            best[h] = bb[i * per + k];
            arg[h] = ba[i * per + k];
          }
        }
  }
};

void scan_rows(const float* u, int64_t H, const Shelf& sh, float floor, float* best,
               int64_t* arg, const Table* tab) {
  RowScan scan(u, sh, H, floor);
  const int64_t blocks = scan.blocks();
  dynamic_for(blocks, scan.rows() * scan.per * sh.D >= (1 << 17) ? 1 : blocks,
              [&](int64_t i0, int64_t i1) {
                for (int64_t i = i0; i < i1; i++) scan.run(i, tab);
              });
  scan.merge(H, best, arg);
}

// SpindleKV's codebook build (spindlekv/store.py's build_codebook: Alg. 1's greedy medoid cover
// with the spec's alive degrees) over u (N, d) float32 unit (or zero) rows in candidate order:
// rows a, b adjacent where u_a . u_b > theta, each row its own neighbour. The graph is made once,
// in tiles of `tile` rows on and above the diagonal (torch's products, each pair's dot once: the
// graph is exactly symmetric, and its degrees those of build_codebook's first pass), kept as
// neighbour lists; then the row with the most alive neighbours (the lowest index on ties)
// becomes an entry and takes them, until no row has an alive neighbour but itself, when the
// rest become entries in index order. -> [order (C,) int64: each entry's row in pick order,
// idx (N,) int64: each row's entry], or two empty tensors where the graph would hold more than
// max_edges edges (the caller's blocked torch path then runs).
std::vector<at::Tensor> codebook_build(const at::Tensor& u_, double theta, int64_t tile,
                                       int64_t max_edges) {
  check_f32(u_, "u");
  TORCH_CHECK(u_.dim() == 2 && tile > 0 && max_edges >= 0,
              "codebook_build: u (N, d), tile and max_edges positive");
  const at::Tensor u = u_.contiguous();
  const int64_t N = u.size(0);
  const float th = (float)theta;
  std::vector<std::vector<int32_t>> nb(N);
  TORCH_CHECK(N < INT32_MAX, "codebook_build: too many rows");
  int64_t edges = 0;
  for (int64_t i = 0; i < N; i += tile) {
    const at::Tensor ui = u.narrow(0, i, std::min(tile, N - i));
    for (int64_t j = i; j < N; j += tile) {
      const int64_t bi = ui.size(0), bj = std::min(tile, N - j);
      const at::Tensor s = at::mm(ui, u.narrow(0, j, bj).t()).contiguous();
      const float* sp = s.data_ptr<float>();
      for (int64_t a = 0; a < bi; a++)
        for (int64_t b = j == i ? a + 1 : 0; b < bj; b++)
          if (sp[a * bj + b] > th) {
            nb[i + a].push_back((int32_t)(j + b));
            nb[j + b].push_back((int32_t)(i + a));
            if (++edges > max_edges) return {at::empty({0}, u.options().dtype(at::kLong)),
                                             at::empty({0}, u.options().dtype(at::kLong))};
          }
    }
  }
  at::Tensor order = at::empty({N}, u.options().dtype(at::kLong));
  at::Tensor idx = at::empty({N}, u.options().dtype(at::kLong));
  int64_t* op = order.data_ptr<int64_t>();
  int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<int64_t> deg(N);
  std::vector<char> alive(N, 1);
  // (degree, -row): the largest degree first, then the lowest row; entries go stale as degrees
  // fall (a fresh one is pushed) and are passed over when popped
  std::priority_queue<std::pair<int64_t, int64_t>> heap;
  for (int64_t a = 0; a < N; a++) {
    deg[a] = 1 + (int64_t)nb[a].size();
    heap.push({deg[a], -a});
  }
  int64_t c = 0;
  std::vector<int32_t> taken;
  while (!heap.empty()) {
    const auto [dg, na] = heap.top();
    heap.pop();
    const int64_t a = -na;
    if (!alive[a] || dg != deg[a]) continue;
    if (dg <= 1) break;  // no alive neighbours left anywhere: the rest are their own entries
    taken.assign(1, (int32_t)a);
    for (const int32_t b : nb[a])
      if (alive[b]) taken.push_back(b);
    for (const int32_t b : taken) {
      alive[b] = 0;
      ip[b] = c;
    }
    op[c++] = a;
    for (const int32_t b : taken)
      for (const int32_t x : nb[b])
        if (alive[x]) heap.push({--deg[x], -(int64_t)x});
  }
  for (int64_t a = 0; a < N; a++)
    if (alive[a]) {
      ip[a] = c;
      op[c++] = a;
    }
  return {order.narrow(0, 0, c).clone(), idx};
}

// SpindleKV's decode-time merging (spindlekv/store.py's `assign`), once each head's best row
// among the rows there before is known (best, arg): in head order, a head joins the better of
// that and the rows earlier heads of the call added if above theta, else its unit vector u
// becomes a new row (in the shelf's dtype, written in place, cnt advanced; the caller checked
// the room) -> idx (H).
void join_or_add(const float* u, int64_t H, const Shelf& sh, const float* best,
                 const int64_t* arg, double theta, int64_t* idx, const Table* tab) {
  const int64_t D = sh.D;
  std::vector<int64_t> before(sh.cnt, sh.cnt + sh.nb);
  for (int64_t h = 0; h < H; h++) {
    const int64_t b = sh.nb == 1 ? 0 : h;
    float bv = best[h];
    int64_t av = arg[h];
    const int64_t made = sh.cnt[b] - before[b];
    if (made > 0) {
      float nbv = bv;
      int64_t nav = 0;
      tab->best_rows(u + h * D, 1, sh.row(b, before[b]), sh.elem, D, made, D, -INFINITY, &nbv,
                     &nav);
      if (nbv > bv) {
        bv = nbv;
        av = before[b] + nav;
      }
    }
    if ((double)bv > theta) {
      idx[h] = av;
      continue;
    }
    char* row = sh.row(b, sh.cnt[b]);
    if (sh.elem == kvq::EL_F16)
      for (int64_t i = 0; i < D; i++)
        reinterpret_cast<uint16_t*>(row)[i] = kvq::fp32_to_fp16(u[h * D + i]);
    else
      std::memcpy(row, u + h * D, D * sizeof(float));
    idx[h] = sh.cnt[b]++;
  }
}

// A shelf tensor (n_books, cap, D) and its books' row counts cnt (n_books) checked for H
// heads' new rows.
Shelf check_shelf(at::Tensor& shelf, int64_t* cnt, int64_t n_cnt, int64_t H, int64_t D,
                  const char* op) {
  const int elem = row_elem(shelf, "shelf");
  TORCH_CHECK(shelf.dim() == 3 && shelf.is_contiguous() && shelf.size(2) == D &&
                  (shelf.size(0) == 1 || shelf.size(0) == H) && n_cnt == shelf.size(0),
              op, ": shelf (1 or H, cap, D) contiguous, a count per book");
  for (int64_t b = 0; b < shelf.size(0); b++)
    TORCH_CHECK(cnt[b] >= 0 && cnt[b] + (shelf.size(0) == 1 ? H : 1) <= shelf.size(1), op,
                ": no room for the new rows");
  return {static_cast<char*>(shelf.data_ptr()), elem, shelf.size(0), shelf.size(1), D, cnt};
}

// SpindleKV's decode-time merging (spindlekv/store.py's `assign`) of x (H, D) float32, one
// vector per KV head in head order, into a shelf (n_books, cap, D) whose book b holds
// counts[b] rows (n_books 1: shared by every head; H: one per head): each unit vector
// u = x / ||x|| joins the first row with the largest u . row if that exceeds theta, else
// becomes a new row (u in the shelf's dtype) that later heads may join. New rows are written
// in place and counts advanced; the caller leaves room -> [idx (H,) int64, ||x|| (H,) float32].
std::vector<at::Tensor> codebook_assign(const at::Tensor& x, at::Tensor& shelf,
                                        at::Tensor& counts, double theta) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "codebook_assign: x (H, D)");
  const int64_t H = x.size(0), D = x.size(1);
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 && counts.is_contiguous(),
              "codebook_assign: counts (n_books,) int64");
  const Shelf sh = check_shelf(shelf, counts.data_ptr<int64_t>(), counts.size(0), H, D,
                               "codebook_assign");
  at::Tensor idx = at::empty({H}, x.options().dtype(at::kLong));
  at::Tensor mag = at::empty({H}, x.options());
  std::vector<float> u(H * D), best(H);
  std::vector<int64_t> arg(H);
  const Table* tab = current();
  unit_rows(x.data_ptr<float>(), x.stride(0), H, D, u.data(), mag.data_ptr<float>());
  scan_rows(u.data(), H, sh, (float)theta, best.data(), arg.data(), tab);
  join_or_add(u.data(), H, sh, best.data(), arg.data(), theta, idx.data_ptr<int64_t>(), tab);
  return {idx, mag};
}
#include "kivi_ops.h"  // KIVI

// MiniCache's MERGE of one row pair a, b (m floats; minicache/store.py's `merge`, the same
// float32 steps): E into er (ua, ub: scratch of m), the norms la, lb, d = Omega / pi and the
// factors n_a / ||E||, n_b / ||E|| merged_attn takes (0 where ||E|| = 0). SLERP of the unit
// rows with weight t (tb) on b where sin(Omega) >= sin_eps, else normalised LERP (u_b below
// 1e-6); zero rows give u = 0.
struct MergedRow {
  float la, lb, d, fa, fb;
};

MergedRow merge_row(const float* a, const float* b, int64_t m, float ta, float tb, float eps,
                    float* ua, float* ub, float* er) {
  float sa = 0.f, sb = 0.f;
  for (int64_t i = 0; i < m; i++) sa += a[i] * a[i], sb += b[i] * b[i];
  const float la = std::sqrt(sa), lb = std::sqrt(sb);
  const float da = la > 0.f ? la : 1.f, db = lb > 0.f ? lb : 1.f;
  float sd = 0.f, ss = 0.f;
  for (int64_t i = 0; i < m; i++) {
    ua[i] = a[i] / da, ub[i] = b[i] / db;
    sd += (ub[i] - ua[i]) * (ub[i] - ua[i]);
    ss += (ub[i] + ua[i]) * (ub[i] + ua[i]);
  }
  const float omega = 2.f * std::atan2(std::sqrt(sd), std::sqrt(ss));
  const float s = std::sin(omega);
  const bool slerp = s >= eps && s > 0.f;
  const float sdiv = slerp ? s : 1.f;
  const float wa = std::sin(ta * omega) / sdiv, wb = std::sin(tb * omega) / sdiv;
  if (slerp) {
    for (int64_t i = 0; i < m; i++) er[i] = wa * ua[i] + wb * ub[i];
  } else {
    float sl = 0.f;
    for (int64_t i = 0; i < m; i++) {
      er[i] = ta * ua[i] + tb * ub[i];
      sl += er[i] * er[i];
    }
    const float ln = std::sqrt(sl), dl = ln > 0.f ? ln : 1.f;
    for (int64_t i = 0; i < m; i++) er[i] = ln >= 1e-6f ? er[i] / dl : ub[i];
  }
  float se = 0.f;
  for (int64_t i = 0; i < m; i++) se += er[i] * er[i];
  const float ne = std::sqrt(se), inv = 1.f / (ne > 0.f ? ne : 1.f);
  return {la, lb, omega / (float)M_PI, la * inv, lb * inv};
}

// merge_row over rows xa, xb (..., m) -> [E (..., m), n_a, n_b, d, the factors of a and b (...)]
std::vector<at::Tensor> minicache_merge(const at::Tensor& xa_, const at::Tensor& xb_, double t,
                                        double sin_eps) {
  check_f32(xa_, "xa");
  check_f32(xb_, "xb");
  TORCH_CHECK(xa_.sizes() == xb_.sizes() && xa_.dim() >= 1, "minicache_merge: xa, xb alike");
  const at::Tensor xa = xa_.contiguous(), xb = xb_.contiguous();
  const int64_t m = xa.size(-1), rows = m ? xa.numel() / m : 0;
  auto lead = xa.sizes().vec();
  lead.pop_back();
  at::Tensor e = at::empty_like(xa);
  at::Tensor na = at::empty(lead, xa.options()), nb = at::empty(lead, xa.options());
  at::Tensor dd = at::empty(lead, xa.options());
  at::Tensor fa = at::empty(lead, xa.options()), fb = at::empty(lead, xa.options());
  std::vector<float> ua(m), ub(m);
  for (int64_t r = 0; r < rows; r++) {
    const MergedRow o = merge_row(xa.data_ptr<float>() + r * m, xb.data_ptr<float>() + r * m, m,
                                  (float)(1.0 - t), (float)t, (float)sin_eps, ua.data(),
                                  ub.data(), e.data_ptr<float>() + r * m);
    na.data_ptr<float>()[r] = o.la;
    nb.data_ptr<float>()[r] = o.lb;
    dd.data_ptr<float>()[r] = o.d;
    fa.data_ptr<float>()[r] = o.fa;
    fb.data_ptr<float>()[r] = o.fb;
  }
  return {e, na, nb, dd, fa, fb};
}

// One float32 value into element i of a float32 or float16 tensor (torch's rounding: RNE)
inline void put_elem(const at::Tensor& x, int64_t i, float v) {
  if (x.scalar_type() == at::kHalf) static_cast<uint16_t*>(x.data_ptr())[i] = kvq::fp32_to_fp16(v);
  else x.data_ptr<float>()[i] = v;
}

// A decode token of a MiniCache pair merged straight into the pair's buffers, K and V in one
// call (what minicache_merge, then each buffer's append, store): xa[h], xb[h] (Hkv, 1, D)
// float32, layers a's and b's rows of half h (0 K, 1 V), merged in g groups of m = Hkv * D / g
// (g = Hkv: per head; 1: the token's row); half h writes E into slot n of e[h] (Hkv, cap, D),
// the norms into slot n of na[h], nb[h] (g, cap) (f32 or f16), the factors into fa[h], fb[h]
// (g, cap) f32. Returns each group's d = Omega / pi (2, g) for a caller that retains.
at::Tensor minicache_merge_into(at::TensorList xa_, at::TensorList xb_, int64_t g, double t,
                                double sin_eps, at::TensorList e, at::TensorList na,
                                at::TensorList nb, at::TensorList fa, at::TensorList fb,
                                int64_t n) {
  TORCH_CHECK(xa_.size() == 2 && xb_.size() == 2 && e.size() == 2 && na.size() == 2 &&
                  nb.size() == 2 && fa.size() == 2 && fb.size() == 2,
              "minicache_merge_into: rows, E, norms and factors of K and V");
  const int64_t H = e[0].dim() == 3 ? e[0].size(0) : 0, D = e[0].dim() == 3 ? e[0].size(2) : 0;
  TORCH_CHECK(g > 0 && H > 0 && (H * D) % g == 0, "minicache_merge_into: g dividing Hkv * D");
  std::vector<at::Tensor> xa(2), xb(2);
  for (int h = 0; h < 2; h++) {
    check_f32(xa_[h], "xa");
    check_f32(xb_[h], "xb");
    TORCH_CHECK(xa_[h].numel() == H * D && xb_[h].numel() == H * D,
                "minicache_merge_into: one token's rows (Hkv, 1, D) a half");
    xa[h] = xa_[h].contiguous();
    xb[h] = xb_[h].contiguous();
  }
  const int64_t m = H * D / g;
  for (int h = 0; h < 2; h++) {
    const at::Tensor& eh = e[h];
    TORCH_CHECK(eh.dim() == 3 && eh.size(0) == H && eh.size(2) == D && n >= 0 &&
                    n < eh.size(1) && (eh.scalar_type() == at::kFloat ||
                                       eh.scalar_type() == at::kHalf),
                "minicache_merge_into: E (Hkv, cap > n, D) float32 or float16");
    for (const at::Tensor* x : {&na[h], &nb[h], &fa[h], &fb[h]})
      TORCH_CHECK(x->dim() == 2 && x->size(0) == g && n < x->size(1) && x->stride(1) == 1 &&
                      (x->scalar_type() == at::kFloat || x->scalar_type() == at::kHalf),
                  "minicache_merge_into: norms and factors (g, cap > n), float32 or float16");
    TORCH_CHECK(fa[h].scalar_type() == at::kFloat && fb[h].scalar_type() == at::kFloat,
                "minicache_merge_into: factors float32");
  }
  at::Tensor dd = at::empty({2, g}, xa[0].options());
  std::vector<float> ua(m), ub(m), er(m);
  for (int h = 0; h < 2; h++) {
    const at::Tensor& eh = e[h];
    for (int64_t r = 0; r < g; r++) {
      const MergedRow o = merge_row(xa[h].data_ptr<float>() + r * m,
                                    xb[h].data_ptr<float>() + r * m, m,
                                    (float)(1.0 - t), (float)t, (float)sin_eps, ua.data(),
                                    ub.data(), er.data());
      for (int64_t i = 0; i < m; i++) {  // element i of the group: head (r m + i) / D
        const int64_t f = r * m + i, hd = f / D, c = f % D;
        put_elem(eh, hd * eh.stride(0) + n * eh.stride(1) + c * eh.stride(2), er[i]);
      }
      put_elem(na[h], r * na[h].stride(0) + n, o.la);
      put_elem(nb[h], r * nb[h].stride(0) + n, o.lb);
      fa[h].data_ptr<float>()[r * fa[h].stride(0) + n] = o.fa;
      fb[h].data_ptr<float>()[r * fb[h].stride(0) + n] = o.fb;
      dd.data_ptr<float>()[h * g + r] = o.d;
    }
  }
  return dd;
}

// One SpindleKV decode token in one call: k, v (Hkv, D) pre-RoPE coded into the shelves as
// codebook_assign does (theta_k, theta_v), written as slot n of the coded segment's buffers
// (idx_k, idx_v, mag_k, mag_v, pos_c (Hkv, cap) and mask (Hkv, cap, ceil(g/8)): position
// `pos`, every keep bit set), and q (1, Hq, 1, D) post-RoPE (pre-RoPE with `ssin`: rotated
// here at pos by cos and ssin, as `rope` does) attending over slots 0..n as codebook_attn does
// (masked: by the keep bits) -> out (1, Hq, 1, D). Each index must fit its buffer (the caller
// widens int16 first).
//
// One parallel region: the attention over slots 0..n-1 in split_keys' chunks, and the search
// of every row the books held before the token in RowScan's blocks (four keys to one
// reduction, not a row at a time as slots point at them); then each head joins or adds a row,
// and the token's own slot is merged into the attention by log-sum-exp.
std::tuple<at::Tensor, std::vector<int64_t>, std::vector<int64_t>> codebook_step(
    const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v, int64_t pos,
    at::Tensor& shelf_k, at::IntArrayRef counts_k, double theta_k, at::Tensor& shelf_v,
    at::IntArrayRef counts_v, double theta_v,
                         at::Tensor& idx_k, at::Tensor& idx_v, at::Tensor& mag_k,
                         at::Tensor& mag_v, at::Tensor& pos_c, at::Tensor& mask, int64_t n,
                         bool masked, const at::Tensor& cos, const at::Tensor& sin,
                         double scale, const OptT& ssin) {
  check_f32(q_, "q");
  check_f32(k, "k");
  check_f32(v, "v");
  // k and v (Hkv, D), or a decode row's (1, Hkv, 1, D) as the model gives them
  const bool row4 = k.dim() == 4 && k.size(0) == 1 && k.size(2) == 1;
  const int64_t H = row4 ? k.size(1) : k.size(0), D = k.size(-1);
  const int64_t ks = row4 ? k.stride(1) : k.stride(0), vs = row4 ? v.stride(1) : v.stride(0);
  TORCH_CHECK((row4 || k.dim() == 2) && k.sizes() == v.sizes() && k.stride(-1) == 1 &&
                  v.stride(-1) == 1 && q_.dim() == 4 && q_.size(0) == 1 && q_.size(2) == 1 &&
                  q_.size(3) == D && H > 0 && q_.size(1) % H == 0 && q_.stride(3) == 1,
              "codebook_step: q (1, Hq, 1, D), k and v (Hkv, D) or (1, Hkv, 1, D)");
  TORCH_CHECK(cos.dim() == 2 && pos >= 0 && pos < cos.size(0), "codebook_step: tables past pos");
  at::Tensor q = q_.contiguous();
  if (ssin.has_value()) {  // q pre-RoPE: rotated here at pos, as `rope` rotates it
    check_f32(*ssin, "ssin");
    TORCH_CHECK(ssin->sizes() == cos.sizes() && ssin->strides() == cos.strides() &&
                    cos.stride(1) == 1 && cos.size(1) == D,
                "codebook_step: cos and ssin tables (P, D) alike");
    at::Tensor qr = at::empty_like(q);
    rope_heads(q, cos.data_ptr<float>() + pos * cos.stride(0),
               ssin->data_ptr<float>() + pos * ssin->stride(0), qr.data_ptr<float>(), current());
    q = qr;
  }
  const int64_t g = q.size(1) / H;
  std::vector<int64_t> ck(counts_k.begin(), counts_k.end()), cv(counts_v.begin(), counts_v.end());
  const Shelf sk = check_shelf(shelf_k, ck.data(), (int64_t)ck.size(), H, D, "codebook_step");
  const Shelf sv = check_shelf(shelf_v, cv.data(), (int64_t)cv.size(), H, D, "codebook_step");
  TORCH_CHECK(sk.elem == sv.elem && sk.nb == sv.nb, "codebook_step: K and V shelves alike");
  for (const at::Tensor* t : {&idx_k, &idx_v, &mag_k, &mag_v, &pos_c})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == H && t->size(1) > n && n >= 0 &&
                    t->is_contiguous(),
                "codebook_step: slot buffers (Hkv, cap > n) contiguous");
  for (const at::Tensor* t : {&idx_k, &idx_v})
    TORCH_CHECK(t->scalar_type() == at::kShort || t->scalar_type() == at::kInt,
                "codebook_step: int16 or int32 indices");
  TORCH_CHECK(mag_k.scalar_type() == mag_v.scalar_type(), "codebook_step: magnitudes alike");
  TORCH_CHECK(pos_c.scalar_type() == at::kInt && mask.scalar_type() == at::kByte &&
                  mask.dim() == 3 && mask.size(0) == H && mask.size(1) == pos_c.size(1) &&
                  mask.size(2) == (g + 7) / 8 && mask.is_contiguous(),
              "codebook_step: pos_c int32, mask (Hkv, cap, ceil(g/8)) uint8");
  const Table* tab = current();
  auto book = [&](const at::Tensor& shelf) {
    return shelf.size(0) == 1 ? shelf[0] : shelf.view({shelf.size(0) * shelf.size(1), D});
  };
  auto offsets = [&](const at::Tensor& shelf) -> OptT {  // book h starts at row h * cap
    if (shelf.size(0) == 1) return c10::nullopt;
    at::Tensor off = at::empty({H}, shelf.options().dtype(at::kInt));
    for (int64_t h = 0; h < H; h++) off.data_ptr<int32_t>()[h] = (int32_t)(h * shelf.size(1));
    return off;
  };
  const OptT off_k = offsets(shelf_k), off_v = offsets(shelf_v);
  // the token's unit vectors and norms
  std::vector<float> uk(H * D), uv(H * D), mk(H), mv(H);
  unit_rows(k.data_ptr<float>(), ks, H, D, uk.data(), mk.data());
  unit_rows(v.data_ptr<float>(), vs, H, D, uv.data(), mv.data());
  const int64_t per_head = sk.nb == 1 ? 0 : 1;
  // attention over slots 0..n-1, and the books' rows before the token searched for its unit
  // vectors (RowScan's blocks) as more tasks of the same parallel region
  RowScan scan_k(uk.data(), sk, H, (float)theta_k), scan_v(uv.data(), sv, H, (float)theta_v);
  const int64_t nk_blocks = scan_k.blocks();
  auto search = [&](int64_t i) {
    if (i < nk_blocks) scan_k.run(i, tab);
    else scan_v.run(i - nk_blocks, tab);
  };
  at::Tensor out = at::empty({1, q.size(1), 1, D}, q.options());
  std::vector<float> lse(H * g);
  const kvq::CodebookArgs a = codebook_args(
      q, book(shelf_k), OptT(idx_k), OptT(mag_k), book(shelf_v), OptT(idx_v), OptT(mag_v), pos_c,
      cos, sin, masked ? OptT(mask) : c10::nullopt, off_k, off_v, scale, n);
  codebook_split(a, H, n, out.data_ptr<float>(), lse.data(), nk_blocks + scan_v.blocks(), search);
  // each head joins its best row or adds one, as codebook_assign
  std::vector<int64_t> ik(H), iv(H);
  for (int side = 0; side < 2; side++) {
    const Shelf& sh = side == 0 ? sk : sv;
    const float* u = side == 0 ? uk.data() : uv.data();
    std::vector<float> b(H);
    std::vector<int64_t> r(H);
    (side == 0 ? scan_k : scan_v).merge(H, b.data(), r.data());
    join_or_add(u, H, sh, b.data(), r.data(), side == 0 ? theta_k : theta_v,
                side == 0 ? ik.data() : iv.data(), tab);
  }
  // slot n written
  auto put_idx = [&](at::Tensor& buf, const std::vector<int64_t>& ix) {
    const int64_t cap = buf.size(1);
    for (int64_t h = 0; h < H; h++) {
      if (buf.scalar_type() == at::kShort) {
        TORCH_CHECK(ix[h] <= 32767, "codebook_step: an index past int16 (widen first)");
        buf.data_ptr<int16_t>()[h * cap + n] = (int16_t)ix[h];
      } else {
        buf.data_ptr<int32_t>()[h * cap + n] = (int32_t)ix[h];
      }
    }
  };
  auto put_mag = [&](at::Tensor& buf, const std::vector<float>& m) {
    const int64_t cap = buf.size(1);
    for (int64_t h = 0; h < H; h++) {
      if (buf.scalar_type() == at::kHalf)
        buf.data_ptr<at::Half>()[h * cap + n] = at::Half(m[h]);
      else
        buf.data_ptr<float>()[h * cap + n] = m[h];
    }
  };
  put_idx(idx_k, ik);
  put_idx(idx_v, iv);
  put_mag(mag_k, mk);
  put_mag(mag_v, mv);
  const int64_t cap = pos_c.size(1), nbytes = mask.size(2);
  for (int64_t h = 0; h < H; h++) {
    pos_c.data_ptr<int32_t>()[h * cap + n] = (int32_t)pos;
    uint8_t* m = mask.data_ptr<uint8_t>() + (h * cap + n) * nbytes;
    for (int64_t j = 0; j < nbytes; j++)
      m[j] = (uint8_t)(j + 1 < nbytes || g % 8 == 0 ? 0xFF : (1 << (g % 8)) - 1);
  }
  // the token's own slot, seen by every query head, merged by log-sum-exp: its key
  // RoPE(row_k * mag_k, pos), its value row_v * mag_v as the buffers hold them
  const float* cs = cos.data_ptr<float>() + pos * cos.stride(0);
  const float* sn = sin.data_ptr<float>() + pos * sin.stride(0);
  std::vector<float> kr(D), vr(D);
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const bool half = mag_k.scalar_type() == at::kHalf;
  for (int64_t h = 0; h < H; h++) {
    const char* rk = sk.row(per_head ? h : 0, ik[h]);
    const char* rv = sv.row(per_head ? h : 0, iv[h]);
    for (int64_t i = 0; i < D; i++) {
      kr[i] = sk.elem == kvq::EL_F16 ? kvq::fp16_to_fp32(reinterpret_cast<const uint16_t*>(rk)[i])
                                     : reinterpret_cast<const float*>(rk)[i];
      vr[i] = sv.elem == kvq::EL_F16 ? kvq::fp16_to_fp32(reinterpret_cast<const uint16_t*>(rv)[i])
                                     : reinterpret_cast<const float*>(rv)[i];
    }
    const float fk = (half ? (float)at::Half(mk[h]) : mk[h]) * (float)scale;
    const float fv = half ? (float)at::Half(mv[h]) : mv[h];
    for (int64_t j = 0; j < g; j++) {
      const float* qr = qp + (h * g + j) * D;
      float s = 0.f;
      for (int64_t i = 0; i < D / 2; i++) {
        const float lo = kr[i], hi = kr[D / 2 + i];
        s += qr[i] * (lo * cs[i] - hi * sn[i]) + qr[D / 2 + i] * (hi * cs[i] + lo * sn[i]);
      }
      s *= fk;
      const float l = lse[h * g + j], m = std::max(l, s);
      const float old = std::exp(l - m), w = std::exp(s - m), total = old + w;
      float* orow = o + (h * g + j) * D;
      for (int64_t i = 0; i < D; i++) orow[i] = (orow[i] * old + w * fv * vr[i]) / total;
    }
  }
  return {out, ck, cv};
}

// A decode row's checks and store, shared by rope_append_attend and rope_append_probs: q, k
// (1, H, 1, D) rotated by RoPE (row pos of the cos, ssin tables (>= pos + 1, D)), q into qr
// (Hq, D), k and v (1, Hkv, 1, D) written to slot n of kbuf, vbuf (1, Hkv, cap, row) in KV type
// `kv_type` (kv_type_of). Returns the type.
int rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& cos, const at::Tensor& ssin, int64_t pos, at::Tensor& kbuf,
               at::Tensor& vbuf, int64_t n, int64_t kv_type, float* qr, const Table* t,
               const char* op) {
  check_rope_row(q, k, v, cos, ssin, pos, op);
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() &&
                  kbuf.scalar_type() == vbuf.scalar_type() && kbuf.size(1) == hkv &&
                  kbuf.is_contiguous() && vbuf.is_contiguous() && n >= 0 && n < kbuf.size(2),
              op, ": buffers (1, Hkv, cap, row) with room for slot n");
  const int type = kv_type_of(kbuf, kv_type, d);
  const int64_t cap = kbuf.size(2), rb = kvq::kv_row_bytes(type, d);
  std::vector<float> kr(d);
  const float *cp = cos.data_ptr<float>() + pos * d, *sp = ssin.data_ptr<float>() + pos * d;
  rope_heads(q, cp, sp, qr, t);
  uint8_t* kb = static_cast<uint8_t*>(kbuf.data_ptr());
  uint8_t* vb = static_cast<uint8_t*>(vbuf.data_ptr());
  for (int64_t h = 0; h < hkv; h++) {
    uint8_t *krow = kb + (h * cap + n) * rb, *vrow = vb + (h * cap + n) * rb;
    const float* vs = v.data_ptr<float>() + h * v.stride(1);
    if (type == kvq::KV_F32) {
      t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, reinterpret_cast<float*>(krow), d);
      std::memcpy(vrow, vs, d * sizeof(float));
    } else {
      t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, kr.data(), d);
      t->kv_store[type](kr.data(), d, krow);
      t->kv_store[type](vs, d, vrow);
    }
  }
  return type;
}

// One decode row of a plain dense cache (rope_store), then q attending over slots 0..n ->
// (1, Hq, 1, D). The same row functions as `rope` and `attn_decode`.
at::Tensor rope_append_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cos, const at::Tensor& ssin, int64_t pos,
                              at::Tensor& kbuf, at::Tensor& vbuf, int64_t n, double scale,
                              int64_t kv_type) {
  const Table* t = current();
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  std::vector<float> qr(hq * d);
  const int type =
      rope_store(q, k, v, cos, ssin, pos, kbuf, vbuf, n, kv_type, qr.data(), t, "rope_append_attend");
  const int64_t cap = kbuf.size(2), rb = kvq::kv_row_bytes(type, d);
  at::Tensor out = at::empty({1, hq, 1, d}, q.options());
  attend_typed(qr.data(), hq, d, static_cast<const uint8_t*>(kbuf.data_ptr()), cap * rb, rb,
               static_cast<const uint8_t*>(vbuf.data_ptr()), cap * rb, rb, type, hkv, n + 1,
               (float)scale, out.data_ptr<float>(), t, 1, nullptr);
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

// One decode row per head (q (Hq, D) contiguous) over t keys in KV type `type`: key j of KV
// head h at k + h * khs + j * kts bytes (values alike) -> out (Hq, D) and p (Hq, t), the
// probabilities the row attended with: the raw scores kept per chunk, made exact once the merge
// gives each row's log-sum-exp. acc (rows of stride as), where given, gets p added: each KV
// head's group summed (Hkv rows) or per query head (Hq rows).
void attend_probs_rows(const float* q, int64_t hq, int64_t d, const uint8_t* k, int64_t khs,
                       int64_t kts, const uint8_t* v, int64_t vhs, int64_t vts, int type,
                       int64_t hkv, int64_t t, float scale, float* out, float* p, float* acc,
                       int64_t acc_rows, int64_t as, const Table* tab) {
  const int64_t g = hq / hkv;
  std::vector<float> lse(hq);
  const bool f32 = type == kvq::KV_F32, f16 = type == kvq::KV_F16;  // read in place
  split_keys(
      hkv, g, t, d, f32 || f16 ? 256 : KV_TILE,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        const float* qh = q + h * g * d;
        const uint8_t *kh = k + h * khs + j0 * kts, *vh = v + h * vhs + j0 * vts;
        float* ph = p + h * g * t + j0;
        if (f16) {
          scratch.resize(g * n);
          tab->attn_chunk_scores_f16(qh, (int)g, reinterpret_cast<const uint16_t*>(kh), kts / 2,
                                     reinterpret_cast<const uint16_t*>(vh), vts / 2, n, d, scale,
                                     part, mx, sm, scratch.data(), ph, t);
          return;
        }
        if (f32) {
          scratch.resize(g * n);
          tab->attn_chunk_scores(qh, (int)g, reinterpret_cast<const float*>(kh), kts / 4,
                                 reinterpret_cast<const float*>(vh), vts / 4, n, d, scale, part,
                                 mx, sm, scratch.data(), ph, t);
          return;
        }
        typed_tiles(tab->kv_load[type], kh, kts, vh, vts, n, g, d, part, mx, sm, scratch,
                    [&](const float* kt, const float* vt, int64_t m, int64_t a, float* o,
                        float* x, float* s, float* sc) {
                      tab->attn_chunk_scores(qh, (int)g, kt, d, vt, d, m, d, scale, o, x, s, sc,
                                             ph + a, t);
                    });
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

// One decode row per head: q (1, Hq, 1, D) over every key of k, v (1, Hkv, T, row) in a KV
// type (kv_type_of) -> [out (1, Hq, 1, D), p (Hq, T)] (attend_probs_rows); acc (Hkv or Hq, T),
// where given, gets p added in place.
std::vector<at::Tensor> attn_probs(const at::Tensor& q_, const at::Tensor& k, const at::Tensor& v,
                                   double scale, const c10::optional<at::Tensor>& acc,
                                   int64_t type) {
  check_f32(q_, "q");
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && q_.size(2) == 1 && k.dim() == 4 &&
                  k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.size(0) == 1 &&
                  q_.size(1) % k.size(1) == 0,
              "attn_probs: q (1, Hq, 1, D), k and v (1, Hkv, T, row)");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), D = q.size(3), Hkv = k.size(1), T = k.size(2);
  const int t = kv_type_of(k, type, D);
  kv_type_of(v, type, D);
  const int64_t es = k.element_size();
  at::Tensor out = at::empty({1, Hq, 1, D}, q.options());
  at::Tensor p = at::empty({Hq, T}, q.options());
  if (acc.has_value()) check_acc(*acc, Hq, Hkv, T, "attn_probs");
  attend_probs_rows(q.data_ptr<float>(), Hq, D, static_cast<const uint8_t*>(k.data_ptr()),
                    k.stride(1) * es, k.stride(2) * es, static_cast<const uint8_t*>(v.data_ptr()),
                    v.stride(1) * es, v.stride(2) * es, t, Hkv, T, (float)scale,
                    out.data_ptr<float>(), p.data_ptr<float>(),
                    acc.has_value() ? acc->data_ptr<float>() : nullptr,
                    acc.has_value() ? acc->size(0) : 0, acc.has_value() ? acc->stride(0) : 0,
                    current());
  return {out, p};
}

// rope_append_attend for a cache that scores its slots by the step's attention (TOVA, H2O):
// rope_store (kbuf, vbuf in KV type kv_type), q attending
// over slots 0..n with its probabilities -> [out (1, Hq, 1, D), p (Hq, n + 1), q rotated
// (1, Hq, 1, D), kpos (R, n + 1) int32 with pos appended (empty without kpos), acc
// (A, n + 1) with the new slot's 0 appended, then p added (empty without acc)].
std::vector<at::Tensor> rope_append_probs(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& cos,
                                          const at::Tensor& ssin, int64_t pos, at::Tensor& kbuf,
                                          at::Tensor& vbuf, int64_t n, double scale,
                                          const c10::optional<at::Tensor>& kpos,
                                          const c10::optional<at::Tensor>& acc,
                                          int64_t kv_type) {
  const Table* t = current();
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3), cap = kbuf.size(2);
  at::Tensor qr = at::empty({1, hq, 1, d}, q.options());
  const int type = rope_store(q, k, v, cos, ssin, pos, kbuf, vbuf, n, kv_type,
                              qr.data_ptr<float>(), t, "rope_append_probs");
  const int64_t rb = kvq::kv_row_bytes(type, d);
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
  attend_probs_rows(qr.data_ptr<float>(), hq, d, static_cast<const uint8_t*>(kbuf.data_ptr()),
                    cap * rb, rb, static_cast<const uint8_t*>(vbuf.data_ptr()), cap * rb, rb,
                    type, hkv, n + 1, (float)scale,
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
  const int64_t H = scores.size(0), C = scores.size(1), Hkv = kbuf.size(1);
  const int64_t rb = kbuf.size(3) * kbuf.element_size();  // a slot's bytes, in any KV type
  TORCH_CHECK(scores.dim() == 2 && pos.dim() == 2 && pos.scalar_type() == at::kInt &&
                  pos.size(0) == H && pos.size(1) >= n && pos.stride(1) == 1 && C <= n && n > 0 &&
                  (H == 1 || H == Hkv),
              "evict_one: scores (1 or Hkv, C <= n), pos (the same rows, >= n) int32");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.sizes() == vbuf.sizes() &&
                  kbuf.scalar_type() == vbuf.scalar_type() && kbuf.is_contiguous() &&
                  vbuf.is_contiguous() && kbuf.size(2) >= n,
              "evict_one: kbuf, vbuf (1, Hkv, cap >= n, row) contiguous, of one type");
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
  uint8_t *kb = static_cast<uint8_t*>(kbuf.data_ptr()), *vb = static_cast<uint8_t*>(vbuf.data_ptr());
  for (int64_t h = 0; h < Hkv; h++) {
    const int64_t j = vic[H == 1 ? 0 : h];
    if (j == L) continue;
    std::memcpy(kb + (h * cap + j) * rb, kb + (h * cap + L) * rb, rb);
    std::memcpy(vb + (h * cap + j) * rb, vb + (h * cap + L) * rb, rb);
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
  m.def("attn_typed(Tensor q, Tensor k, Tensor v, float scale, int type=0) -> Tensor[]",
        &attn_typed);
  m.def("kv_encode(Tensor x, int type) -> Tensor", &kv_encode);
  m.def("kv_decode(Tensor x, int type, int d) -> Tensor", &kv_decode);
  m.def(
      "merged_attn(Tensor q, Tensor e_k, Tensor s_k, Tensor e_v, Tensor s_v, bool unit, "
      "Tensor? ridx_k, Tensor? roff_k, Tensor? rows_k, Tensor? ridx_v, Tensor? roff_v, "
      "Tensor? rows_v, int r_grp, Tensor? k_new, Tensor? v_new, float scale) -> Tensor[]",
      &merged_attn);
  m.def(
      "codebook_attn(Tensor q, Tensor book_k, Tensor? idx_k, Tensor? mag_k, Tensor book_v, "
      "Tensor? idx_v, Tensor? mag_v, Tensor pos, Tensor cos, Tensor sin, Tensor? mask, "
      "Tensor? off_k, Tensor? off_v, float scale) -> Tensor[]",
      &codebook_attn);
  m.def("codebook_build(Tensor u, float theta, int tile, int max_edges) -> Tensor[]",
        &codebook_build);
  m.def("codebook_assign(Tensor x, Tensor(a!) shelf, Tensor(b!) counts, float theta) -> Tensor[]",
        &codebook_assign);
  // KIVI (kivi_ops.h)
  m.def("kivi_pack(Tensor k, Tensor v, int bits, int group, bool half=False) -> Tensor[]", &kivi_pack);
  m.def(
      "kivi_attn(Tensor q, Tensor kc, Tensor ks, Tensor kz, Tensor vc, Tensor vs, Tensor vz, "
      "int tb, Tensor tk, Tensor tv, int tt, int bits, int group, int n_new, float scale) -> "
      "Tensor[]",
      &kivi_attn);
  m.def(
      "kivi_rope_append_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor kc, Tensor ks, Tensor kz, Tensor vc, Tensor vs, Tensor vz, int tb, Tensor(a!) tk, "
      "Tensor(b!) tv, int tt, int bits, int group, float scale) -> Tensor",
      &kivi_rope_append_attend);
  m.def(
      "kivi_merged_attn(Tensor q, Tensor kc, Tensor ks, Tensor kz, Tensor vc, Tensor vs, "
      "Tensor vz, int tb, Tensor tk, Tensor tv, int tt, int bits, int group, Tensor nk, "
      "Tensor nv, Tensor kinv, Tensor vinv, Tensor? ridx_k, Tensor? roff_k, Tensor? rows_k, "
      "Tensor? ridx_v, Tensor? roff_v, Tensor? rows_v, Tensor k_new, Tensor v_new, "
      "float scale, Tensor? cos=None, Tensor? ssin=None, int pos=0) -> Tensor[]",
      &kivi_merged_attn);
  m.def(
      "kivi_dequant(Tensor kc, Tensor ks, Tensor kz, Tensor vc, Tensor vs, Tensor vz, int bits, "
      "int group, int t0, int t1) -> Tensor[]",
      &kivi_dequant);
  m.def("minicache_merge(Tensor xa, Tensor xb, float t, float sin_eps) -> Tensor[]",
        &minicache_merge);
  m.def(
      "rope_merged_attn(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor e_k, Tensor s_k, Tensor e_v, Tensor s_v, Tensor? ridx_k, Tensor? roff_k, "
      "Tensor? rows_k, Tensor? ridx_v, Tensor? roff_v, Tensor? rows_v, int r_grp, "
      "float scale) -> Tensor[]",
      &rope_merged_attn);
  m.def(
      "minicache_merge_into(Tensor[] xa, Tensor[] xb, int g, float t, float sin_eps, Tensor(a!)[] e, "
      "Tensor(b!)[] na, Tensor(c!)[] nb, Tensor(d!)[] fa, Tensor(e!)[] fb, int n) -> Tensor",
      &minicache_merge_into);
  m.def(
      "minicache_step(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor(a!)[] bufs, int n, bool second, Tensor? ka, Tensor? va, Tensor? ridx_k, "
      "Tensor? roff_k, Tensor? rows_k, Tensor? ridx_v, Tensor? roff_v, Tensor? rows_v, "
      "int r_grp, int g, float t, float sin_eps, float scale) -> Tensor[]",
      &minicache_step);
  m.def(
      "codebook_step(Tensor q, Tensor k, Tensor v, int pos, Tensor(a!) shelf_k, "
      "int[] counts_k, float theta_k, Tensor(b!) shelf_v, int[] counts_v, float theta_v, "
      "Tensor(c!) idx_k, Tensor(d!) idx_v, Tensor(e!) mag_k, Tensor(f!) mag_v, "
      "Tensor(g!) pos_c, Tensor(h!) mask, int n, bool masked, Tensor cos, Tensor sin, "
      "float scale, Tensor? ssin=None) -> (Tensor, int[], int[])",
      &codebook_step);
  // attention that keeps its probabilities (tova_attn.h)
  m.def(
      "attn_probs(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!)? acc=None, int type=0) "
      "-> Tensor[]",
      &attn_probs);
  m.def(
      "rope_append_probs(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor ssin, int pos, "
      "Tensor(a!) kbuf, Tensor(b!) vbuf, int n, float scale, Tensor? kpos=None, Tensor? acc=None, "
      "int kv_type=0) -> Tensor[]",
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
      "Tensor(a!) kbuf, Tensor(b!) vbuf, int n, float scale, int kv_type=0) -> Tensor",
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
