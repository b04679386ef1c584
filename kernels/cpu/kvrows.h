// K/V rows in the cache types llama.cpp's -ctk/-ctv offer (f16, bf16, q8_0, q4_0), to float32
// and back: what a dense KV store holds and what attention reads a tile of keys through.
// Included by qkernels.cpp inside its anonymous namespace (one copy per instruction set).
// q8_0 and q4_0 are ggml's reference quantizers (quantize_row_q8_0_ref, quantize_row_q4_0_ref):
// the same scales, rounding and bytes, so a cache row is the block llama.cpp would store.

// f16 row (d halves) -> float
void kv_load_f16(const uint8_t* src, int64_t d, float* out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
  for (; i < d; i++) out[i] = kvq::fp16_to_fp32(h[i]);
}

void kv_store_f16(const float* x, int64_t d, uint8_t* dst) {
  uint16_t* h = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), 0));
#endif
  for (; i < d; i++) h[i] = kvq::fp32_to_fp16(x[i]);
}

// bf16: the top half of a float32 (round to nearest even on the way in, as torch rounds)
void kv_load_bf16(const uint8_t* src, int64_t d, float* out) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= d; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < d; i++) {
    const uint32_t bits = (uint32_t)h[i] << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

void kv_store_bf16(const float* x, int64_t d, uint8_t* dst) {
  uint16_t* h = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < d; i++) {
    uint32_t bits;
    std::memcpy(&bits, x + i, 4);
    if ((bits & 0x7FFFFFFF) > 0x7F800000) {  // NaN stays a (quiet) NaN
      h[i] = (uint16_t)((bits >> 16) | 0x40);
      continue;
    }
    bits += 0x7FFF + ((bits >> 16) & 1);
    h[i] = (uint16_t)(bits >> 16);
  }
}

// q8_0: per 32 values an fp16 scale d = amax / 127 and codes round(x / d)
void kv_load_q8_0(const uint8_t* src, int64_t d, float* out) {
  for (int64_t b = 0; b < d / 32; b++, src += 34, out += 32) {
    const float s = f16(src);
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
#if defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(s);
    for (int j = 0; j < 32; j += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + j)));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sv));
    }
#else
    for (int j = 0; j < 32; j++) out[j] = (float)q[j] * s;
#endif
  }
}

void kv_store_q8_0(const float* x, int64_t d, uint8_t* dst) {
  for (int64_t b = 0; b < d / 32; b++, x += 32, dst += 34) {
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(x[j]));
    const float s = amax / 127.f, id = s != 0.f ? 1.f / s : 0.f;
    const uint16_t h = kvq::fp32_to_fp16(s);
    std::memcpy(dst, &h, 2);
    for (int j = 0; j < 32; j++) dst[2 + j] = (uint8_t)(int8_t)std::roundf(x[j] * id);
  }
}

// q4_0: per 32 values an fp16 scale d = (the value of largest magnitude) / -8, codes
// min(15, trunc(x / d + 8.5)), two a byte (value j low, value j + 16 high)
void kv_load_q4_0(const uint8_t* src, int64_t d, float* out) {
  for (int64_t b = 0; b < d / 32; b++, src += 18, out += 32) {
    const float s = f16(src);
    for (int j = 0; j < 16; j++) {
      out[j] = s * (float)((src[2 + j] & 15) - 8);
      out[j + 16] = s * (float)((src[2 + j] >> 4) - 8);
    }
  }
}

void kv_store_q4_0(const float* x, int64_t d, uint8_t* dst) {
  for (int64_t b = 0; b < d / 32; b++, x += 32, dst += 18) {
    float amax = 0.f, mx = 0.f;
    for (int j = 0; j < 32; j++)
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        mx = x[j];
      }
    const float s = mx / -8.f, id = s != 0.f ? 1.f / s : 0.f;
    const uint16_t h = kvq::fp32_to_fp16(s);
    std::memcpy(dst, &h, 2);
    for (int j = 0; j < 16; j++) {
      const uint8_t lo = (uint8_t)std::min(15, (int)(int8_t)(x[j] * id + 8.5f));
      const uint8_t hi = (uint8_t)std::min(15, (int)(int8_t)(x[j + 16] * id + 8.5f));
      dst[2 + j] = lo | (uint8_t)(hi << 4);
    }
  }
}
