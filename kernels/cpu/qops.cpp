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
//   isa() -> str                  the instruction set the products run on
//   set_isa(name) -> str          pick one ("best", "portable", "avx2", ...); returns the one taken
//   has_gemm(code) -> bool        whether a type (| X8_FLAG) has a native product here
//
// x is quantized once per call (q8_0/q8_1 and/or q8_K, as the types read them) and shared by
// every weight in the call: Q, K and V of a layer (or gate and up) make one call even where
// their types differ. Threads: PyTorch's own pool (at::parallel_for), over tiles of weight rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>
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

constexpr int64_t TILE_ROWS = 16;  // weight rows a task takes (two interleaved groups)

at::Tensor qmm(const at::Tensor& x, at::TensorList ws, at::IntArrayRef codes,
               at::IntArrayRef rows) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(ws.size() == codes.size() && ws.size() == rows.size() && !ws.empty(),
              "one type and one row count per weight");
  const Table* t = current();
  const int64_t m = x.size(0), k = x.size(1);
  bool need32 = false, needK = false;
  std::vector<Weight> wts;
  std::vector<int64_t> start{0};       // first output column of each weight
  std::vector<int64_t> tile_start{0};  // first tile of each weight
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
  const int64_t n = start.back();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const ActBuffers buf(x.data_ptr<float>(), m, k, need32, needK, t);
  float* yp = y.data_ptr<float>();
  // enough tiles per task that a task is worth a thread's wake-up (~16 KB of weights)
  const int64_t tile_bytes = TILE_ROWS * k / 2;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile_bytes));
  at::parallel_for(0, tile_start.back(), grain, [&](int64_t b, int64_t e) {
    size_t seg = 0;
    for (int64_t tile = b; tile < e; tile++) {
      while (tile >= tile_start[seg + 1]) seg++;
      const Weight& w = wts[seg];
      const int64_t r0 = (tile - tile_start[seg]) * TILE_ROWS;
      const int64_t cnt = std::min<int64_t>(TILE_ROWS, w.n - r0);
      const uint8_t* base = w.t->data_ptr<uint8_t>();
      if (w.x8)
        t->gemm_x8[w.type](base + r0 / kvq::X8 * w.row_bytes, w.row_bytes, cnt, buf.act, m,
                           yp + start[seg] + r0, n);
      else
        t->gemm[w.type](base + r0 * w.row_bytes, w.row_bytes, cnt, buf.act, m,
                        yp + start[seg] + r0, n);
    }
  });
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
                   const c10::optional<at::Tensor>& idx) {
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
  at::Tensor out = at::empty({count, k}, wt.options().dtype(at::kFloat));
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

bool has_dequant(int64_t type) {
  return type >= 0 && type < kvq::NTYPES && current()->dequant[type] != nullptr;
}

bool has_x8(int64_t type) { return type >= 0 && type < kvq::NTYPES && kvq::has_x8((int)type); }

}  // namespace

TORCH_LIBRARY(kvrun_cpu, m) {
  m.def("qmm(Tensor x, Tensor[] ws, int[] codes, int[] rows) -> Tensor", &qmm);
  m.def("dequant(Tensor w, int code, int n, int k, Tensor? idx=None) -> Tensor", &dequant);
  m.def("repack(Tensor w, int type, int k) -> Tensor", &repack);
  m.def("unpack(Tensor w, int type, int n, int k) -> Tensor", &unpack);
  m.def("has_x8(int type) -> bool", &has_x8);
  m.def("quantize_act(Tensor x, int kind) -> Tensor[]", &quantize_act);
  m.def("isa() -> str", &isa);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("has_gemm(int type) -> bool", &has_gemm);
  m.def("has_dequant(int type) -> bool", &has_dequant);
}
