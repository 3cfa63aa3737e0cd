// One instruction set's copy of the layer ops' vector code (layer_ops.cpp), compiled by isa_copies.h for baseline
// x86-64, AVX2 and AVX-512. The source is the same in every copy and the compiler vectorises it for the copy's
// instruction set; the parts written with intrinsics (SLEEF's vector exp, the 8-key dot products) are there where
// ISA_LEVEL allows them, and attention's weighted sums run in vectors of the copy's register width (ISA_LANES).

typedef float Floats __attribute__((vector_size(ISA_LANES * 4)));

// exp_scalar's values, in SLEEF's vector exp where this copy has one and libtorch exports it. One vector at a time,
// the tail through a zero-padded copy so that every value takes the same exp. Full vectors are loaded and stored
// directly (a lane-by-lane copy in and out made silu_mul three times as slow at 32 rows); sign * x - shift is the
// same two operations either way.
#if ISA_LEVEL >= 2
inline bool has_vector_exp() { return Sleef_expf16_u10avx512f != nullptr; }
inline Floats vector_exp(Floats v) { return (Floats)Sleef_expf16_u10avx512f((__m512)v); }
#elif ISA_LEVEL == 1
inline bool has_vector_exp() { return Sleef_expf8_u10avx2 != nullptr; }
inline Floats vector_exp(Floats v) { return (Floats)Sleef_expf8_u10avx2((__m256)v); }
#endif
void exp_array(const float* in, float* out, int64_t n, float sign, float shift) {
#if ISA_LEVEL >= 1
  if (has_vector_exp()) {
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES) {
      Floats v;
      std::memcpy(&v, in + i, sizeof v);
      v = vector_exp(v * sign - shift);
      std::memcpy(out + i, &v, sizeof v);
    }
    if (i < n) {
      alignas(64) float lane[ISA_LANES] = {};
      for (int64_t l = 0; l < n - i; ++l) lane[l] = sign * in[i + l] - shift;
      Floats v;
      std::memcpy(&v, lane, sizeof v);
      v = vector_exp(v);
      std::memcpy(lane, &v, sizeof v);
      std::copy(lane, lane + (n - i), out + i);
    }
    return;
  }
#endif
  exp_scalar(in, out, n, sign, shift);
}

// scores[j] = (q . k_j) * scale for `count` keys `stride` floats apart. A dot product per key ends in a sum across
// its lanes, which had cost more than the multiply-adds; on AVX2 (every AVX-512 CPU runs it too) eight keys' lanes
// are reduced together by a tree of horizontal adds, one vector add per key. Only the order of each sum changes.
void key_scores(const float* q, const float* keys, int64_t stride, int64_t count, int64_t dim, float scale,
                float* scores) {
#if ISA_LEVEL >= 1
  if (dim % 8 == 0) {
    for (int64_t j = 0; j < count; j += 8) {
      const int keys_here = (int)std::min<int64_t>(8, count - j);
      __m256 acc[8];
      for (int p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int p = 0; p < keys_here; ++p)
          acc[p] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys + (j + p) * stride + d), acc[p]);
      }
      // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | the same for the high halves]: after three levels, lane p of the
      // low half plus lane p of the high half is key p's sum.
      const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      const __m256 low = _mm256_permute2f128_ps(h0123, h4567, 0x20), high = _mm256_permute2f128_ps(h0123, h4567, 0x31);
      alignas(32) float sums[8];
      _mm256_store_ps(sums, _mm256_mul_ps(_mm256_add_ps(low, high), _mm256_set1_ps(scale)));
      std::copy(sums, sums + keys_here, scores + j);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j) scores[j] = sum_of_products(q, keys + j * stride, dim) * scale;
}

void add_rms_row(float* hidden, const float* delta, const float* weight, float* out, int64_t n, float eps) {
  if (delta != nullptr)
    for (int64_t i = 0; i < n; ++i) hidden[i] += delta[i];
  const float sum = sum_of_products(hidden, hidden, n);
  const float inv = 1.f / std::sqrt(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (hidden[i] * inv);
}

void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  exp_array(gate, out, n, -1.f, 0.f);  // exp(-gate), then torch's silu: gate / (1 + exp(-gate))
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.f + out[i]) * up[i];
}

// HF's (x * cos) + (rotate_half(x) * sin) for one head of `dim` values.
void rope_head(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// Attention of one run of query heads over their sequence's blocks (layer_ops.cpp says what each argument holds).
void attend(const float* q, int64_t count, const void* keys, const void* values, KvFormat format, const int64_t* table,
            int64_t context, int64_t block_size, int64_t stride, int64_t dim, float scale, float* scores,
            float* widened, float* out) {
  int64_t row_stride = stride;
  // Block by block: a division per position (a 64-bit divide is tens of cycles) cost more than its dot product.
  for (int64_t start = 0; start < context; start += block_size) {
    const int64_t end = std::min(context, start + block_size), first = table[start / block_size] * block_size * stride;
    const float* k = block_rows(keys, first, end - start, stride, dim, format, widened, row_stride, kIsa);
    for (int64_t h = 0; h < count; ++h)
      key_scores(q + h * dim, k, row_stride, end - start, dim, scale, scores + h * context + start);
  }
  for (int64_t h = 0; h < count; ++h) {
    float* s = scores + h * context;
    float top = -INFINITY;
    for (int64_t j = 0; j < context; ++j) top = std::max(top, s[j]);
    exp_array(s, s, context, 1.f, top);
  }
  for (int64_t start = 0; start < context; start += block_size) {
    const int64_t end = std::min(context, start + block_size), first = table[start / block_size] * block_size * stride;
    const float* v = block_rows(values, first, end - start, stride, dim, format, widened, row_stride, kIsa);
    for (int64_t h = 0; h < count; ++h)
      add_weighted_rows<Floats>(scores + h * context + start, v, end - start, row_stride, dim, out + h * dim);
  }
  for (int64_t h = 0; h < count; ++h) {
    const float* s = scores + h * context;
    const float inverse = 1.f / lane_sum(context, [=](int64_t j) { return s[j]; });
    for (int64_t i = 0; i < dim; ++i) out[h * dim + i] *= inverse;
  }
}
