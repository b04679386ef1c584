// The KIVI store's torch ops (kvrun/kv/stores/kivi.py): its flush (quantize and pack, bit for
// bit kernels/kivi_pack.py's reference), one layer's attention over the packed body and the
// dense tail in one split_keys call, and a range of the body dequantized (for a prefill
// chunk's many queries, which torch's flash attention serves best). Included by qops.cpp
// after attn_partial, inside its anonymous namespace.

// ---------------------------------------------------------------------------- flush
// G values x[0], x[stride], ... quantized as kivi_pack_ref quantizes a group (min and max in
// float32, scale = (max - min) / (2^b - 1) and zero = min rounded to the scales' type S first,
// codes round-half-even((x - zero) / scale) clamped, code 0 for a flat group), packed into
// G / (32 / b) words, code i at bits [b*i, b*i + b)
template <typename S>
void kivi_quant_group(const float* x, int64_t stride, int64_t G, int bits, int32_t* words,
                      S* scale, S* zero) {
  float lo = x[0], hi = x[0];
  for (int64_t j = 1; j < G; j++) {
    const float v = x[j * stride];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const float top = (float)((1 << bits) - 1);
  *scale = (S)((hi - lo) / top);
  *zero = (S)lo;
  const float s = (float)*scale;
  lo = (float)*zero;
  const int per = 32 / bits;
  for (int64_t w = 0; w < G / per; w++) {
    uint32_t word = 0;
    for (int i = 0; i < per; i++) {
      uint32_t code = 0;
      if (s != 0.f) {
        const float y = std::nearbyint((x[(w * per + i) * stride] - lo) / s);
        code = (uint32_t)std::min(std::max(y, 0.f), top);
      }
      word |= code << (i * bits);
    }
    words[w] = (int32_t)word;
  }
}

void check_kivi_layout(int64_t bits, int64_t group, int64_t d) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "kivi: bits must be 1, 2, 4 or 8");
  TORCH_CHECK(group > 0 && group % (32 / bits) == 0 && d % group == 0,
              "kivi: the group must be a multiple of 32 / bits dividing head_dim");
}

// k, v (H, n, D) float32 with contiguous rows -> [k_codes (H, n/G, D, G*b/32) int32, k_scale,
// k_zero (H, n/G, D) (block-major), v_codes (H, n, D*b/32) int32, v_scale, v_zero (H, n, D/G)]:
// kivi_pack_ref; the scales and zeros float16 where half (the KV dtype's), else float32
template <typename S>
std::vector<at::Tensor> kivi_pack_as(const at::Tensor& k, const at::Tensor& v, int64_t bits,
                                     int64_t group) {
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "kivi_pack: k and v (H, n, D) with contiguous rows");
  const int64_t H = k.size(0), n = k.size(1), D = k.size(2), G = group, per = 32 / bits;
  check_kivi_layout(bits, group, D);
  TORCH_CHECK(n % G == 0, "kivi_pack: ", n, " tokens are not whole groups of ", G);
  const auto i32 = k.options().dtype(at::kInt);
  const int64_t ng = n / G;
  const auto st = k.options().dtype(c10::CppTypeToScalarType<S>::value);
  at::Tensor kc = at::empty({H, ng, D, G / per}, i32), ks = at::empty({H, ng, D}, st);
  at::Tensor kz = at::empty_like(ks), vc = at::empty({H, n, D / per}, i32);
  at::Tensor vs = at::empty({H, n, D / G}, st), vz = at::empty_like(vs);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t khs = k.stride(0), kts = k.stride(1), vhs = v.stride(0), vts = v.stride(1);
  at::parallel_for(0, H * D, 16, [&](int64_t b, int64_t e) {
    for (int64_t hc = b; hc < e; hc++) {
      const int64_t h = hc / D, c = hc % D;
      for (int64_t g = 0; g < ng; g++) {
        const int64_t row = (h * ng + g) * D + c;  // the group's channel c
        kivi_quant_group(kp + h * khs + g * G * kts + c, kts, G, (int)bits,
                         kc.data_ptr<int32_t>() + row * (G / per), ks.data_ptr<S>() + row,
                         kz.data_ptr<S>() + row);
      }
    }
  });
  at::parallel_for(0, H * n, 64, [&](int64_t b, int64_t e) {
    for (int64_t ht = b; ht < e; ht++) {
      const float* x = vp + (ht / n) * vhs + (ht % n) * vts;
      for (int64_t g = 0; g < D / G; g++)
        kivi_quant_group(x + g * G, 1, G, (int)bits,
                         vc.data_ptr<int32_t>() + ht * (D / per) + g * (G / per),
                         vs.data_ptr<S>() + ht * (D / G) + g, vz.data_ptr<S>() + ht * (D / G) + g);
    }
  });
  return {kc, ks, kz, vc, vs, vz};
}

std::vector<at::Tensor> kivi_pack(const at::Tensor& k, const at::Tensor& v, int64_t bits,
                                  int64_t group, bool half) {
  return half ? kivi_pack_as<at::Half>(k, v, bits, group) : kivi_pack_as<float>(k, v, bits, group);
}

// ---------------------------------------------------------------------------- the body
// KiviLayer's six body buffers (its Buffers' whole tensors, room included) and the tokens held,
// checked: keys block-major, (H, >= tb/G, D, G*b/32) words and (H, >= tb/G, D) scales, zeros;
// values (H, >= tb, D*b/32) words and (H, >= tb, D/G) scales, zeros; contiguous last dimensions
struct KiviBody {
  int64_t H, Tb, D, bits, G;
  const at::Tensor *kc, *ks, *kz, *vc, *vs, *vz;

  KiviBody(const at::Tensor& kc_, const at::Tensor& ks_, const at::Tensor& kz_,
           const at::Tensor& vc_, const at::Tensor& vs_, const at::Tensor& vz_, int64_t tb,
           int64_t bits_, int64_t group)
      : kc(&kc_), ks(&ks_), kz(&kz_), vc(&vc_), vs(&vs_), vz(&vz_) {
    const auto sdt = ks->scalar_type();
    for (const at::Tensor* t : {ks, kz, vs, vz})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == sdt &&
                      (sdt == at::kFloat || sdt == at::kHalf),
                  "kivi scales and zeros: all float32 or all float16 CPU tensors");
    for (const at::Tensor* t : {kc, vc})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt, "kivi codes: int32");
    for (const at::Tensor* t : {kc, ks, kz, vc, vs, vz})
      TORCH_CHECK(t->dim() == (t == kc ? 4 : 3) && t->stride(t->dim() - 1) == 1,
                  "kivi body: key words 4-D, the rest 3-D, contiguous last dims");
    H = kc->size(0), Tb = tb, D = kc->size(2), bits = bits_, G = group;
    check_kivi_layout(bits, G, D);
    const int64_t per = 32 / bits;
    bool ok = Tb >= 0 && Tb % G == 0 && kc->size(1) >= Tb / G && kc->size(3) == G / per;
    for (const at::Tensor* t : {ks, kz})
      ok = ok && t->size(0) == H && t->size(1) >= Tb / G && t->size(2) == D;
    for (const at::Tensor* t : {vs, vz})
      ok = ok && t->size(0) == H && t->size(1) >= Tb && t->size(2) == D / G;
    ok = ok && vc->size(0) == H && vc->size(1) >= Tb && vc->size(2) == D / per;
    TORCH_CHECK(ok, "kivi body: buffers do not hold ", Tb, " tokens of ", bits, " bits, group ", G);
  }

  kvq::KiviHead head(int64_t h) const {
    kvq::KiviHead b;
    b.kc = kc->data_ptr<int32_t>() + h * kc->stride(0);
    b.kc_g = kc->stride(1), b.kc_c = kc->stride(2);
    const int64_t es = ks->element_size();  // the scales' and zeros' bytes (2 where half)
    b.half = es == 2;
    b.ks = (const char*)ks->data_ptr() + h * ks->stride(0) * es;
    b.kz = (const char*)kz->data_ptr() + h * kz->stride(0) * es;
    b.ks_g = ks->stride(1), b.kz_g = kz->stride(1);
    b.vc = vc->data_ptr<int32_t>() + h * vc->stride(0);
    b.vc_t = vc->stride(1);
    b.vs = (const char*)vs->data_ptr() + h * vs->stride(0) * es;
    b.vz = (const char*)vz->data_ptr() + h * vz->stride(0) * es;
    b.vs_t = vs->stride(1);
    b.vz_t = vz->stride(1);
    return b;
  }
};

// part, mx, sm (R rows) merged with another partial of the same rows (p2, m2, s2)
void merge_partial(int64_t R, int64_t d, float* part, float* mx, float* sm, const float* p2,
                   const float* m2, const float* s2) {
  for (int64_t i = 0; i < R; i++) {
    const float m = std::max(mx[i], m2[i]);
    if (m == -INFINITY) continue;
    const float a = std::exp(mx[i] - m), b = std::exp(m2[i] - m);
    for (int64_t c = 0; c < d; c++) part[i * d + c] = part[i * d + c] * a + p2[i * d + c] * b;
    sm[i] = sm[i] * a + s2[i] * b;
    mx[i] = m;
  }
}

// A KIVI store's dense tail: float32 (the model's), or float16 (the KV dtype's, baselines.md
// §5's fp16 tail; the CPU's default), k and v alike.
void check_tail(const at::Tensor& tk, const at::Tensor& tv, const char* op) {
  const auto st = tk.scalar_type();
  TORCH_CHECK(tk.device().is_cpu() && tv.device().is_cpu() && tv.scalar_type() == st &&
                  (st == at::kFloat || st == at::kHalf),
              op, ": the tail's k and v must be float32 or float16 CPU tensors, alike");
}

// The attention of q (Hq, Tq, D) contiguous over a packed body (slots 0 .. Tb - 1) then a
// dense tail tk, tv (H, >= Tt, D) float32 or float16 (slots Tb .. Tb + Tt - 1), read in place
// (check_tail), merged exactly: every slot
// visible when n_new = 0, else the last n_new slots are the queries' own and query i sees the
// slots up to its own (the body's too, where a flush put own tokens there). out (Hq * Tq, D);
// lse (Hq * Tq) or nullptr. heads (H) or nullptr: the body's heads as kivi_merged_attn sets them.
void kivi_rows(const float* qp, int64_t Hq, int64_t Tq, const KiviBody& body, const at::Tensor& tk,
               const at::Tensor& tv, int64_t Tt, int64_t n_new, float sc, float* out, float* lse,
               const kvq::KiviHead* heads = nullptr) {
  const int64_t H = body.H, Tb = body.Tb, D = body.D, G = body.G, bits = body.bits;
  TORCH_CHECK(tk.dim() == 3 && tk.sizes() == tv.sizes() && tk.strides() == tv.strides() &&
                  tk.size(0) == H && tk.size(1) >= Tt && tk.size(2) == D && tk.stride(2) == 1,
              "kivi: tail k and v (H, >= Tt, D) alike, contiguous rows");
  TORCH_CHECK(Hq % H == 0, "kivi: query heads are not a multiple of the store's ", H);
  const int64_t g = Hq / H, R = g * Tq, L = Tb + Tt;
  TORCH_CHECK(n_new >= 0 && n_new <= L, "kivi: n_new ", n_new, " of ", L, " slots");
  // the rows of KV head h are (g, Tq): row a * Tq + i is query i; it sees slots below lim[i]
  std::vector<int64_t> lim(R);
  for (int64_t r = 0; r < R; r++) lim[r] = n_new ? std::min(L, L - n_new + r % Tq + 1) : L;
  const int64_t lo = R ? *std::min_element(lim.begin(), lim.end()) : L;
  std::vector<float> qs(Hq * Tq * D);  // q times the scale: the body's scores take it folded in
  for (size_t i = 0; i < qs.size(); i++) qs[i] = qp[i] * sc;
  const kvq::Table* tab = current();
  check_tail(tk, tv, "kivi");
  const int64_t ths = tk.stride(0), tts = tk.stride(1);
  // rows [from, from + n) of head h's tail for `rows` query rows qq: the float32 or float16
  // chunk kernel over them
  const bool t16 = tk.scalar_type() == at::kHalf;
  const void *tkp = tk.data_ptr(), *tvp = tv.data_ptr();
  const auto tail_chunk = [&](const float* qq, int rows, int64_t h, int64_t from, int64_t n,
                              float* P, float* M, float* S, float* att) {
    const int64_t o = h * ths + from * tts;
    if (t16)
      tab->attn_chunk_f16(qq, rows, static_cast<const uint16_t*>(tkp) + o, tts,
                          static_cast<const uint16_t*>(tvp) + o, tts, n, D, sc, P, M, S, att);
    else
      tab->attn_chunk(qq, rows, static_cast<const float*>(tkp) + o, tts,
                      static_cast<const float*>(tvp) + o, tts, n, D, sc, P, M, S, att);
  };
  const int64_t kscr = kvq::kivi_scratch(R, D, G);
  // chunks of keys: as many per head as make the tasks a multiple of the threads (3 heads on
  // 2 threads: 2 chunks a head, not split_keys' 3), where they stay long enough
  const int64_t threads = at::get_num_threads();
  int64_t min_chunk = G * ((256 + G - 1) / G), nc = 1;
  while ((H * nc) % threads && nc < threads) nc++;
  const int64_t even = ((L + nc - 1) / nc + G - 1) / G * G;
  if (even >= min_chunk && even * 4 * threads >= H * L) min_chunk = even;
  split_keys(
      H, R, L, D, min_chunk,
      [&](int64_t h, int64_t j0, int64_t n, float* part, float* mx, float* sm,
          std::vector<float>& scratch) {
        const int64_t jb = std::min(j0 + n, Tb), t0 = std::max(j0, Tb) - Tb, t1 = j0 + n - Tb;
        const bool in_body = j0 < Tb, in_tail = t1 > t0;
        const int64_t nt = in_tail ? t1 - t0 : 0;
        scratch.resize(kscr + R * (D + 2) + R * nt + 2 * g * (D + 1));
        float* p2 = scratch.data() + kscr;  // the tail's partial, then gathered rows
        float *m2 = p2 + R * D, *s2 = m2 + R, *att = s2 + R, *qg = att + R * nt;
        float *pg = qg + g * D, *mg = pg + g * D, *sg = mg + g;
        if (in_body)
          tab->kivi_chunk(qs.data() + h * R * D, R, heads ? heads[h] : body.head(h), (int)bits,
                          (int)G, j0, jb - j0,
                          D, lo >= jb ? nullptr : lim.data(), part, mx, sm, scratch.data());
        if (!in_tail) return;
        float *P = in_body ? p2 : part, *M = in_body ? m2 : mx, *S = in_body ? s2 : sm;
        if (lo - Tb >= t1) {  // every row sees the whole range
          tail_chunk(qp + h * R * D, (int)R, h, t0, nt, P, M, S, att);
        } else {  // query i sees [t0, lim[i] - Tb): its g rows (one per query head) at a time
          for (int64_t r = 0; r < R; r++) {
            M[r] = -INFINITY;
            S[r] = 0.f;
            for (int64_t c = 0; c < D; c++) P[r * D + c] = 0.f;
          }
          for (int64_t i = 0; i < Tq; i++) {
            const int64_t e = std::min(t1, lim[i] - Tb);
            if (e <= t0) continue;
            for (int64_t a = 0; a < g; a++)
              std::memcpy(qg + a * D, qp + (h * R + a * Tq + i) * D, D * sizeof(float));
            tail_chunk(qg, (int)g, h, t0, e - t0, pg, mg, sg, att);
            for (int64_t a = 0; a < g; a++) {
              const int64_t r = a * Tq + i;
              std::memcpy(P + r * D, pg + a * D, D * sizeof(float));
              M[r] = mg[a];
              S[r] = sg[a];
            }
          }
        }
        if (in_body) merge_partial(R, D, part, mx, sm, p2, m2, s2);
      },
      out, lse);
}

// One layer of KiviLayer.partials in one call: q (1, Hq, Tq, D) over the body (tb tokens of
// the six body buffers) and the tail (tt rows of tk, tv) as kivi_rows says -> [out (1, Hq, Tq,
// D), lse (1, Hq, Tq)]
std::vector<at::Tensor> kivi_attn(const at::Tensor& q_, const at::Tensor& kc, const at::Tensor& ks,
                                  const at::Tensor& kz, const at::Tensor& vc, const at::Tensor& vs,
                                  const at::Tensor& vz, int64_t tb, const at::Tensor& tk,
                                  const at::Tensor& tv, int64_t tt, int64_t bits, int64_t group,
                                  int64_t n_new, double scale) {
  check_f32(q_, "q");
  check_tail(tk, tv, "kivi_attn");
  const KiviBody body(kc, ks, kz, vc, vs, vz, tb, bits, group);
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && q_.size(3) == body.D,
              "kivi_attn: q (1, Hq, Tq, D)");
  const at::Tensor q = q_.contiguous();
  const int64_t Hq = q.size(1), Tq = q.size(2), D = body.D;
  at::Tensor out = at::empty({1, Hq, Tq, D}, q.options());
  at::Tensor lse = at::empty({1, Hq, Tq}, q.options());
  kivi_rows(q.data_ptr<float>(), Hq, Tq, body, tk, tv, tt, n_new, (float)scale,
            out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

// A decode row of a KIVI store in one call, as rope_append_attend is a dense cache's: q, k
// (1, H, 1, D) rotated by RoPE (row pos of cos, ssin), k and v written to tail row tt of tk, tv
// (H, > tt, D), q attending over the body (tb tokens) and tail rows 0 .. tt -> (1, Hq, 1, D)
at::Tensor kivi_rope_append_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& cos, const at::Tensor& ssin, int64_t pos,
                                   const at::Tensor& kc, const at::Tensor& ks,
                                   const at::Tensor& kz, const at::Tensor& vc,
                                   const at::Tensor& vs, const at::Tensor& vz, int64_t tb,
                                   at::Tensor& tk, at::Tensor& tv, int64_t tt, int64_t bits,
                                   int64_t group, double scale) {
  for (const at::Tensor* t : {&q, &k, &v, &cos, &ssin}) check_f32(*t, "tensors");
  check_tail(tk, tv, "kivi_rope_append_attend");
  const KiviBody body(kc, ks, kz, vc, vs, vz, tb, bits, group);
  const int64_t hq = q.size(1), H = body.H, d = body.D;
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && q.size(2) == 1 && q.size(3) == d &&
                  k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1 && k.size(1) == H &&
                  k.size(2) == 1 && k.size(3) == d && q.stride(3) == 1 && k.stride(3) == 1 &&
                  v.stride(3) == 1,
              "kivi_rope_append_attend: q (1, Hq, 1, D), k and v (1, H, 1, D)");
  TORCH_CHECK(tk.dim() == 3 && tk.sizes() == tv.sizes() && tk.strides() == tv.strides() &&
                  tk.size(0) == H && tk.size(2) == d && tk.stride(2) == 1 && tt >= 0 &&
                  tt < tk.size(1),
              "kivi_rope_append_attend: tail buffers (H, cap, D) with room for row tt");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.dim() == 2 &&
                  cos.sizes() == ssin.sizes() && cos.size(1) == d && pos >= 0 && pos < cos.size(0),
              "kivi_rope_append_attend: cos and ssin tables (>= pos + 1, D)");
  const kvq::Table* t = current();
  std::vector<float> qr(hq * d);
  const float *cp = cos.data_ptr<float>() + pos * d, *sp = ssin.data_ptr<float>() + pos * d;
  for (int64_t h = 0; h < hq; h++)
    t->rope(q.data_ptr<float>() + h * q.stride(1), cp, sp, qr.data() + h * d, d);
  // k rotated and v into tail row tt, in the tail's type (float16: as torch rounds, to nearest even)
  const int64_t hs = tk.stride(0), rs = tk.stride(1), es = tk.element_size();
  uint8_t *kb = static_cast<uint8_t*>(tk.data_ptr()), *vb = static_cast<uint8_t*>(tv.data_ptr());
  std::vector<float> kr(d);
  for (int64_t h = 0; h < H; h++) {
    uint8_t *krow = kb + (h * hs + tt * rs) * es, *vrow = vb + (h * hs + tt * rs) * es;
    const float* vh = v.data_ptr<float>() + h * v.stride(1);
    if (es == 4) {
      t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, reinterpret_cast<float*>(krow), d);
      std::memcpy(vrow, vh, d * sizeof(float));
    } else {
      t->rope(k.data_ptr<float>() + h * k.stride(1), cp, sp, kr.data(), d);
      t->kv_store[kvq::KV_F16](kr.data(), d, krow);
      t->kv_store[kvq::KV_F16](vh, d, vrow);
    }
  }
  at::Tensor out = at::empty({1, hq, 1, d}, q.options());
  kivi_rows(qr.data(), hq, 1, body, tk, tv, tt + 1, 1, (float)scale, out.data_ptr<float>(),
            nullptr);
  return out;
}

// ---------------------------------------------------------------------------- MiniCache's pairs
// A merged pair's half (minicache+kivi4): its retained rows, checked. ridx (N) int32, each KV
// head's indices ascending in its run [roff[h], roff[h + 1]) of roff (H + 1) int64, rows (N, D)
// float32; all three None when it retains none.
struct Retained {
  const int32_t* idx = nullptr;
  const int64_t* off = nullptr;
  const float* rows = nullptr;

  Retained(const c10::optional<at::Tensor>& ridx, const c10::optional<at::Tensor>& roff,
           const c10::optional<at::Tensor>& rows_, int64_t H, int64_t D, int64_t L) {
    if (!ridx.has_value()) {
      TORCH_CHECK(!roff.has_value() && !rows_.has_value(), "kivi_merged: ridx, roff, rows together");
      return;
    }
    TORCH_CHECK(roff.has_value() && rows_.has_value(), "kivi_merged: ridx, roff, rows together");
    const at::Tensor &ri = *ridx, &ro = *roff, &rw = *rows_;
    check_f32(rw, "retained rows");
    TORCH_CHECK(ri.device().is_cpu() && ri.scalar_type() == at::kInt && ri.dim() == 1 &&
                    ri.is_contiguous() && ro.device().is_cpu() && ro.scalar_type() == at::kLong &&
                    ro.dim() == 1 && ro.is_contiguous() && ro.size(0) == H + 1 && rw.dim() == 2 &&
                    rw.is_contiguous() && rw.size(0) == ri.size(0) && rw.size(1) == D,
                "kivi_merged: ridx (N) int32, roff (H + 1) int64, rows (N, D) float32");
    idx = ri.data_ptr<int32_t>(), off = ro.data_ptr<int64_t>(), rows = rw.data_ptr<float>();
    bool ok = off[0] == 0 && off[H] == ri.size(0);
    for (int64_t h = 0; ok && h < H; h++) {
      ok = off[h] <= off[h + 1];
      for (int64_t r = off[h]; ok && r < off[h + 1]; r++)
        ok = idx[r] >= 0 && idx[r] < L && (r == off[h] || idx[r] > idx[r - 1]);
    }
    TORCH_CHECK(ok, "kivi_merged: retained rows not ascending tokens of the ", L, " held");
  }

  // head h's retained rows among the body's first tb tokens: [first, first + count)
  int64_t body_rows(int64_t h, int64_t tb, int64_t* first) const {
    if (idx == nullptr) return *first = 0;
    *first = off[h];
    return std::lower_bound(idx + off[h], idx + off[h + 1], (int32_t)tb) - (idx + off[h]);
  }
};

// minicache+kivi4's pair layer, a decode row: a pair keeps its merged directions E in a KIVI
// store (E_K as keys, E_V as values) and this layer attends over X_hat = E * n / ||E|| (its own
// norms n), the retained rows exact, nothing restored. q (1, Hq, 1, D) over the body (tb
// tokens: scores and value weights times n * 1 / ||E||, kinv / vinv (H, >= tb) those of the
// dequantized rows, 0 for a zero row), the tail (tt exact rows of E, their factors here) and the
// step's own k_new, v_new (1, H, 1, D). Norms nk, nv (H, >= tb + tt) float32. With cos, ssin
// (tables, row pos) q and k_new are pre-RoPE and rotated here (rope's arithmetic) -> [out (1,
// Hq, 1, D), k_new rotated (1, H, 1, D)]; without, both post-RoPE -> [out, k_new].
std::vector<at::Tensor> kivi_merged_attn(const at::Tensor& q_, const at::Tensor& kc, const at::Tensor& ks,
                            const at::Tensor& kz, const at::Tensor& vc, const at::Tensor& vs,
                            const at::Tensor& vz, int64_t tb, const at::Tensor& tk,
                            const at::Tensor& tv, int64_t tt, int64_t bits, int64_t group,
                            const at::Tensor& nk, const at::Tensor& nv, const at::Tensor& kinv,
                            const at::Tensor& vinv, const c10::optional<at::Tensor>& ridx_k,
                            const c10::optional<at::Tensor>& roff_k,
                            const c10::optional<at::Tensor>& rows_k,
                            const c10::optional<at::Tensor>& ridx_v,
                            const c10::optional<at::Tensor>& roff_v,
                            const c10::optional<at::Tensor>& rows_v, const at::Tensor& k_new,
                            const at::Tensor& v_new, double scale,
                            const c10::optional<at::Tensor>& cos,
                            const c10::optional<at::Tensor>& ssin, int64_t pos) {
  for (const at::Tensor* t : {&q_, &nk, &nv, &kinv, &vinv, &k_new, &v_new})
    check_f32(*t, "kivi_merged_attn's tensors");
  check_tail(tk, tv, "kivi_merged_attn");
  const KiviBody body(kc, ks, kz, vc, vs, vz, tb, bits, group);
  const int64_t H = body.H, D = body.D, L = tb + tt;
  TORCH_CHECK(q_.dim() == 4 && q_.size(0) == 1 && q_.size(2) == 1 && q_.size(3) == D &&
                  q_.size(1) % H == 0,
              "kivi_merged_attn: q (1, Hq, 1, D), Hq a multiple of the store's ", H);
  TORCH_CHECK(k_new.dim() == 4 && k_new.sizes() == v_new.sizes() && k_new.size(0) == 1 &&
                  k_new.size(1) == H && k_new.size(2) == 1 && k_new.size(3) == D,
              "kivi_merged_attn: k_new, v_new (1, H, 1, D)");
  TORCH_CHECK(tk.dim() == 3 && tk.sizes() == tv.sizes() && tk.size(0) == H && tk.size(1) >= tt &&
                  tk.size(2) == D && tk.stride(2) == 1 && tv.stride(2) == 1 && tt >= 0,
              "kivi_merged_attn: tail k and v (H, >= tt, D), contiguous rows");
  for (const at::Tensor* t : {&nk, &nv, &kinv, &vinv})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == H && t->stride(1) == 1 &&
                    t->size(1) >= (t == &nk || t == &nv ? L : tb),
                "kivi_merged_attn: norms (H, >= tb + tt), inverse norms (H, >= tb)");
  const Retained rk(ridx_k, roff_k, rows_k, H, D, L), rv(ridx_v, roff_v, rows_v, H, D, L);
  at::Tensor q = q_.contiguous(), kn = k_new.contiguous();
  const at::Tensor vn = v_new.contiguous();
  TORCH_CHECK(cos.has_value() == ssin.has_value(), "kivi_merged_attn: cos and ssin together");
  if (cos.has_value()) {  // pre-RoPE: rotated as kivi_rope_append_attend rotates
    check_f32(*cos, "cos");
    check_f32(*ssin, "ssin");
    TORCH_CHECK(cos->is_contiguous() && ssin->is_contiguous() && cos->dim() == 2 &&
                    cos->sizes() == ssin->sizes() && cos->size(1) == D && pos >= 0 &&
                    pos < cos->size(0),
                "kivi_merged_attn: cos and ssin tables (>= pos + 1, D)");
    const kvq::Table* t = current();
    const float *cp = cos->data_ptr<float>() + pos * D, *sp = ssin->data_ptr<float>() + pos * D;
    at::Tensor qr = at::empty_like(q), kr = at::empty_like(kn);
    for (int64_t h = 0; h < q.size(1); h++)
      t->rope(q.data_ptr<float>() + h * D, cp, sp, qr.data_ptr<float>() + h * D, D);
    for (int64_t h = 0; h < H; h++)
      t->rope(kn.data_ptr<float>() + h * D, cp, sp, kr.data_ptr<float>() + h * D, D);
    q = qr, kn = kr;
  }
  // the tail's rows as this layer restores them, the retained exact, then the step's own row
  // (a float16 tail's fewer than R rows read as float32 first)
  const bool t16 = tk.scalar_type() == at::kHalf;
  const at::Tensor tkf = t16 ? tk.narrow(1, 0, tt).to(at::kFloat) : tk;
  const at::Tensor tvf = t16 ? tv.narrow(1, 0, tt).to(at::kFloat) : tv;
  at::Tensor tkx = at::empty({H, tt + 1, D}, q.options()), tvx = at::empty_like(tkx);
  for (int s = 0; s < 2; s++) {
    const at::Tensor &src = s ? tvf : tkf, &nrm = s ? nv : nk;
    const Retained& ret = s ? rv : rk;
    float* dst = (s ? tvx : tkx).data_ptr<float>();
    for (int64_t h = 0; h < H; h++) {
      const float* n = nrm.data_ptr<float>() + h * nrm.stride(0) + tb;
      for (int64_t t = 0; t < tt; t++) {
        const float* e = src.data_ptr<float>() + h * src.stride(0) + t * src.stride(1);
        float* o = dst + (h * (tt + 1) + t) * D;
        double ss = 0.0;
        for (int64_t c = 0; c < D; c++) ss += (double)e[c] * e[c];
        const float norm = (float)std::sqrt(ss), f = norm > 0.f ? n[t] / norm : 0.f;
        for (int64_t c = 0; c < D; c++) o[c] = e[c] * f;
      }
      if (ret.idx != nullptr)
        for (int64_t r = ret.off[h]; r < ret.off[h + 1]; r++)
          if (ret.idx[r] >= tb)
            std::memcpy(dst + (h * (tt + 1) + ret.idx[r] - tb) * D, ret.rows + r * D,
                        D * sizeof(float));
      const at::Tensor& own = s ? vn : kn;
      std::memcpy(dst + (h * (tt + 1) + tt) * D, own.data_ptr<float>() + h * D, D * sizeof(float));
    }
  }
  std::vector<kvq::KiviHead> heads(H);
  for (int64_t h = 0; h < H; h++) {
    kvq::KiviHead& b = heads[h];
    b = body.head(h);
    b.kf = nk.data_ptr<float>() + h * nk.stride(0), b.kfi = kinv.data_ptr<float>() + h * kinv.stride(0);
    b.vf = nv.data_ptr<float>() + h * nv.stride(0), b.vfi = vinv.data_ptr<float>() + h * vinv.stride(0);
    int64_t first;
    b.nk = rk.body_rows(h, tb, &first);
    if (b.nk) b.kr = rk.idx + first, b.krow = rk.rows + first * D;
    b.nv = rv.body_rows(h, tb, &first);
    if (b.nv) b.vr = rv.idx + first, b.vrow = rv.rows + first * D;
  }
  at::Tensor out = at::empty({1, q.size(1), 1, D}, q.options());
  kivi_rows(q.data_ptr<float>(), q.size(1), 1, body, tkx, tvx, tt + 1, 0, (float)scale,
            out.data_ptr<float>(), nullptr, heads.data());
  return {out, kn};
}

// Body tokens [t0, t1) (whole groups, of the body buffers) dequantized -> [k, v (1, H, t1 - t0,
// D) float32], the torch reference's values (KiviLayer.dequantized)
std::vector<at::Tensor> kivi_dequant(const at::Tensor& kc, const at::Tensor& ks,
                                     const at::Tensor& kz, const at::Tensor& vc,
                                     const at::Tensor& vs, const at::Tensor& vz, int64_t bits,
                                     int64_t group, int64_t t0, int64_t t1) {
  const KiviBody body(kc, ks, kz, vc, vs, vz, t1, bits, group);
  const int64_t H = body.H, D = body.D, G = group, n = t1 - t0;
  TORCH_CHECK(t0 >= 0 && t0 <= t1 && t1 <= body.Tb && t0 % G == 0 && t1 % G == 0,
              "kivi_dequant: [", t0, ", ", t1, ") is not whole groups of the body");
  const auto f32 = ks.options().dtype(at::kFloat);  // float32 whatever the scales' type
  at::Tensor k = at::empty({1, H, n, D}, f32), v = at::empty({1, H, n, D}, f32);
  const kvq::Table* tab = current();
  const int64_t per = std::max<int64_t>(G, 256 / G * G), blocks = (n + per - 1) / per;
  at::parallel_for(0, H * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; task++) {
      const int64_t h = task / blocks, s = task % blocks * per, m = std::min(per, n - s);
      tab->kivi_dequant(body.head(h), (int)bits, (int)G, t0 + s, m, D,
                        k.data_ptr<float>() + (h * n + s) * D, v.data_ptr<float>() + (h * n + s) * D);
    }
  });
  return {k, v};
}
