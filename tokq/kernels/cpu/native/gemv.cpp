// tokq's native CPU kernels for decode: weight-only int4 and int8 GEMV (few rows of activations), built at first use
// by tokq/kernels/cpu/native.py with this machine's compiler for this machine's instruction set (-march=native).
//
// Both quantize the activations to int8 on the fly, per block of 32 (int4) or 64 (int8) values with an fp32 scale
// each, as llama.cpp's Q8 activations do, and compute the integer dot products with VNNI (vpdpbusd: unsigned 8-bit
// x signed 8-bit -> int32) where the CPU has it, or AVX2's vpmaddubsw + vpmaddwd, or plain C. The weights are read
// once per call whatever the number of activation rows (M <= 32), which is what makes decode bandwidth-bound.
//
// int4 layout (pack_int4 in native.py): unsigned codes u = q + 8 in 0..15, row-major [N, K/2] bytes; each chunk of
// 32 weights is 16 bytes, byte j = u[j] | u[j + 16] << 4. W[n, k] = (u - 8) * scale[n, g] + zero[n, g], zero being
// -z * scale (0 when symmetric), g = k / group_size. y[m, n] = sum_g scale * sum_{k in g} (u - 8) x + zero * sum x.
// int8 layout: codes q [N, K] (signed) and, for VNNI, the same codes + 128 as unsigned bytes; one scale per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define TOKQ_VNNI256 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define TOKQ_VNNI512 1
#endif

namespace {

// Activations of one row quantized to int8 in blocks of `block` values.
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<float> scale;  // per block
  std::vector<float> scaled_sum;  // per block: scale * sum(q)
  std::vector<float> group_sum;  // int4: per weight group, the sum of its blocks' scaled_sum (empty until made)
  // int4 on AVX-512: per pair of 32-blocks, the codes in the order the unpacked weights come out of a 256-bit load
  // ([b0 0:16, b1 0:16, b0 16:32, b1 16:32]) and the 16 lanes' block scales ([s0 x4, s1 x4, s0 x4, s1 x4])
  std::vector<int8_t> pair_q;
  std::vector<float> pair_scale;
};

void arrange_pairs(QuantRow& r, int64_t K) {
  const int64_t pairs = K / 64;
  r.pair_q.resize(K);
  r.pair_scale.resize(pairs * 16);
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* b0 = r.q.data() + p * 64;
    int8_t* out = r.pair_q.data() + p * 64;
#if defined(__AVX512F__)
    // the four 16-byte quarters [b0 lo, b0 hi, b1 lo, b1 hi] reordered to [b0 lo, b1 lo, b0 hi, b1 hi]
    const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(b0));
    _mm512_storeu_si512(reinterpret_cast<void*>(out), _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)));
#else
    const int8_t* b1 = b0 + 32;
    for (int j = 0; j < 16; ++j) {
      out[j] = b0[j]; out[16 + j] = b1[j]; out[32 + j] = b0[16 + j]; out[48 + j] = b1[16 + j];
    }
#endif
    for (int lane = 0; lane < 16; ++lane) r.pair_scale[p * 16 + lane] = r.scale[2 * p + ((lane / 4) % 2)];
  }
}

QuantRow quantize_row(const float* x, int64_t K, int64_t block) {
  QuantRow r;
  r.q.resize(K);
  r.scale.resize(K / block);
  r.scaled_sum.resize(K / block);
#if defined(__AVX512F__)
  if (block % 16 == 0) {
    // The same numbers as the plain loop below: cvtps rounds to nearest even, as nearbyint does in the default
    // rounding mode. Vectorized because it runs serially before the parallel part, once per row and call (at 16
    // rows of K = 1536 the plain loop was ~60 us a call).
    const __m512 sign_off = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + b * block;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < block; k += 16) amax = _mm512_max_ps(amax, _mm512_and_ps(_mm512_loadu_ps(xb + k), sign_off));
      const float m = _mm512_reduce_max_ps(amax);
      const float s = m > 0.f ? m / 127.f : 1.f, inv = 1.f / s;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t k = 0; k < block; k += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k), _mm512_set1_ps(inv)));
        v = _mm512_min_epi32(_mm512_set1_epi32(127), _mm512_max_epi32(_mm512_set1_epi32(-127), v));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + b * block + k), _mm512_cvtepi32_epi8(v));
        sum = _mm512_add_epi32(sum, v);
      }
      r.scale[b] = s;
      r.scaled_sum[b] = s * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
    return r;
  }
#endif
  for (int64_t b = 0; b < K / block; ++b) {
    float amax = 0.f;
    for (int64_t k = 0; k < block; ++k) amax = std::max(amax, std::fabs(x[b * block + k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
    int32_t sum = 0;
    for (int64_t k = 0; k < block; ++k) {
      int32_t v = static_cast<int32_t>(std::nearbyint(x[b * block + k] * inv));
      v = std::min(127, std::max(-127, v));
      r.q[b * block + k] = static_cast<int8_t>(v);
      sum += v;
    }
    r.scale[b] = s;
    r.scaled_sum[b] = s * static_cast<float>(sum);
  }
  return r;
}

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 32 unsigned 8-bit values (0..15 or 0..255 with |x| small enough) times 32 signed: 8 int32 partial sums.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(TOKQ_VNNI256)
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
#else
  // u <= 15 here (int4 codes), |s| <= 127: a pair sums to at most 3810, no 16-bit saturation
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

// The part of an int4 row's dot product that does not depend on its codes: sum_g (zero_g - 8 scale_g) * sum_{k in g} x_k.
inline float int4_offset(const float* scale, const float* zero, int64_t G, int64_t chunks_per_group, const QuantRow& x) {
  float offset = 0.f;
  if (static_cast<int64_t>(x.group_sum.size()) == G) {  // the sums per weight group, made once per call
    for (int64_t g = 0; g < G; ++g) offset += (zero[g] - 8.f * scale[g]) * x.group_sum[g];
    return offset;
  }
  for (int64_t g = 0; g < G; ++g) {
    float sum = 0.f;
    for (int64_t c = 0; c < chunks_per_group; ++c) sum += x.scaled_sum[g * chunks_per_group + c];
    offset += (zero[g] - 8.f * scale[g]) * sum;
  }
  return offset;
}

void add_group_sums(QuantRow& r, int64_t G, int64_t chunks_per_group) {
  r.group_sum.assign(G, 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks_per_group; ++c) r.group_sum[g] += r.scaled_sum[g * chunks_per_group + c];
}

// One int4 row against one quantized activation row.
inline float int4_row(const uint8_t* w, const float* scale, const float* zero, const QuantRow& x, int64_t K,
                      int64_t group) {
  const int64_t chunks_per_group = group / 32;
  const float offset = int4_offset(scale, zero, K / group, chunks_per_group, x);
#if defined(__AVX2__)
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 16));
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m256i u = _mm256_set_m128i(hi, lo);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + c * 32));
    const __m256 d = _mm256_cvtepi32_ps(dot_u8s8(u, xv));
    acc = _mm256_fmadd_ps(d, _mm256_set1_ps(scale[c / chunks_per_group] * x.scale[c]), acc);
  }
  return hsum256(acc) + offset;
#else
  float total = 0.f;
  for (int64_t c = 0; c < K / 32; ++c) {
    int32_t d = 0;
    for (int64_t j = 0; j < 16; ++j) {
      d += static_cast<int32_t>(w[c * 16 + j] & 0x0F) * x.q[c * 32 + j];
      d += static_cast<int32_t>(w[c * 16 + j] >> 4) * x.q[c * 32 + 16 + j];
    }
    total += static_cast<float>(d) * scale[c / chunks_per_group] * x.scale[c];
  }
  return total + offset;
#endif
}

constexpr int64_t PREFETCH_QUADS = 4;
// and into L2, further on: with both, the int8 LM head [49152, 576] (one 28 MB call) went from 9.7 to 16.7 GB/s at 1
// thread on a 2-core EPYC (Zen 4)
constexpr int64_t PREFETCH_L2_QUADS = 16;

#if defined(TOKQ_VNNI512)
// Four consecutive int4 rows against MB activation rows (AVX-512 VNNI): 64 weights (two 32-chunks, 32 packed bytes)
// per row per step, one 512-bit vpdpbusd per row and activation row. Each weight load is unpacked once for all MB
// activation rows, and the loops run by weight group so that no index is divided in the inner loop (an idiv per
// step held this kernel to ~1 byte a cycle). out[m][r]: activation row m's result for weight row r.
template <int MB>
inline void int4_quad_vnni512(const uint8_t* w, int64_t row_bytes, const float* scale, const float* zero, int64_t G,
                              const QuantRow* const* xs_rows, int64_t K, int64_t group, float* const* out);
#endif


// Four consecutive int4 rows against one activation row (AVX2, or AVX-512 when K is not a multiple of 64): four
// independent accumulators (one row alone is bound by the latency of its single FMA chain) sharing each activation
// load.
inline void int4_rows4(const uint8_t* w, int64_t row_bytes, const float* scale, const float* zero, int64_t G,
                       const QuantRow& x, int64_t K, int64_t group, float* out) {
#if defined(__AVX2__)
  const int64_t chunks_per_group = group / 32;
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {  // by group: no division in the inner loop
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + c * 32));
      const float xs = x.scale[c];
      for (int r = 0; r < 4; ++r) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + c * 16));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m256 d = _mm256_cvtepi32_ps(dot_u8s8(_mm256_set_m128i(hi, lo), xv));
        acc[r] = _mm256_fmadd_ps(d, _mm256_set1_ps(scale[r * G + g] * xs), acc[r]);
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    out[r] = hsum256(acc[r]) + int4_offset(scale + r * G, zero + r * G, G, chunks_per_group, x);
#else
  for (int r = 0; r < 4; ++r)
    out[r] = int4_row(w + r * row_bytes, scale + r * G, zero + r * G, x, K, group);
#endif
}

#if defined(TOKQ_VNNI512)
template <int MB>
inline void int4_quad_vnni512(const uint8_t* w, int64_t row_bytes, const float* scale, const float* zero, int64_t G,
                              const QuantRow* const* xs_rows, int64_t K, int64_t group, float* const* out) {
  const int64_t chunks_per_group = group / 32;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  // the 32 packed bytes in both halves, shifted by 0 (low nibbles) in the low half and 4 (high) in the high half
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  auto step = [&](int64_t p, const __m512* ws) {
    __m512i u[4];
    for (int r = 0; r < 4; ++r) {
      // Rows of a few hundred bytes are too short for the hardware's stream prefetch to catch up with four of them
      // read side by side: fetch the same place PREFETCH_QUADS quads on (prefetches past the end never fault).
      // Measured on SmolLM2's decoder shapes, 1 thread: 15 ms a sweep of its 120 layers without, 6 ms with.
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_QUADS * 4) * row_bytes + p * 32), _MM_HINT_T0);
      const __m512i v = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + p * 32)));
      u[r] = _mm512_and_si512(_mm512_srlv_epi16(v, shifts), mask);
    }
    for (int m = 0; m < MB; ++m) {
      const QuantRow& x = *xs_rows[m];
      const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(x.pair_q.data() + p * 64));
      const __m512 xs = _mm512_loadu_ps(x.pair_scale.data() + p * 16);
      for (int r = 0; r < 4; ++r) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r], xv));
        acc[m][r] = _mm512_fmadd_ps(d, _mm512_mul_ps(xs, ws[r]), acc[m][r]);
      }
    }
  };
  __m512 ws[4];
  if (chunks_per_group == 1) {  // groups of 32: a pair of chunks spans two groups, lanes 4-7 and 12-15 the second
    for (int64_t p = 0; p < K / 64; ++p) {
      for (int r = 0; r < 4; ++r)
        ws[r] = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(scale[r * G + 2 * p]),
                                     _mm512_set1_ps(scale[r * G + 2 * p + 1]));
      step(p, ws);
    }
  } else {
    const int64_t pairs_per_group = chunks_per_group / 2;
    for (int64_t g = 0; g < G; ++g) {
      for (int r = 0; r < 4; ++r) ws[r] = _mm512_set1_ps(scale[r * G + g]);
      for (int64_t j = 0; j < pairs_per_group; ++j) step(g * pairs_per_group + j, ws);
    }
  }
  // the code-independent part, sum_g (zero_g - 8 scale_g) * group_sum_g, added lane-wise before the one reduction
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 k = G - g >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (G - g)) - 1);
    __m512 zb[4];
    for (int r = 0; r < 4; ++r)
      zb[r] = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), _mm512_maskz_loadu_ps(k, scale + r * G + g),
                               _mm512_maskz_loadu_ps(k, zero + r * G + g));
    for (int m = 0; m < MB; ++m) {
      const __m512 gs = _mm512_maskz_loadu_ps(k, xs_rows[m]->group_sum.data() + g);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(zb[r], gs, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

#if defined(TOKQ_VNNI512)
// Four consecutive int8 rows (unsigned codes + 128) against MB activation rows quantized per block of 64 (AVX-512
// VNNI): one vpdpbusd per row, block and activation row, each weight load shared by the MB rows. out[m][r] is the
// dot product before the row's scale; the +128 of the codes is taken back out (sum_b 128 * scaled_sum_b).
template <int MB>
inline void int8_quad_vnni512(const uint8_t* wu, int64_t K, const QuantRow* const* xs_rows, float* const* out) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 64; ++b) {
    __m512i w[4];
    for (int r = 0; r < 4; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wu + (r + PREFETCH_QUADS * 4) * K + b * 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wu + (r + PREFETCH_L2_QUADS * 4) * K + b * 64), _MM_HINT_T1);
      w[r] = _mm512_loadu_si512(reinterpret_cast<const void*>(wu + r * K + b * 64));
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(xs_rows[m]->q.data() + b * 64));
      const __m512 xs = _mm512_set1_ps(xs_rows[m]->scale[b]);
      for (int r = 0; r < 4; ++r)
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xv)), xs,
                                    acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)  // group_sum[0]: the row's whole sum_b scaled_sum_b, made once per call
    for (int r = 0; r < 4; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]) - 128.f * xs_rows[m]->group_sum[0];
}
#endif

// One int8 row (signed codes w, or unsigned w + 128 as wu for VNNI) against one activation row in blocks of 64.
inline float int8_row(const int8_t* w, const uint8_t* wu, const QuantRow& x, int64_t K) {
#if defined(__AVX2__) && defined(TOKQ_VNNI256)
  (void)w;
  __m256 acc = _mm256_setzero_ps();
  float correction = 0.f;  // sum_b 128 * scale_b * sum(x_b): the +128 of the unsigned codes taken back out
  for (int64_t b = 0; b < K / 64; ++b) {
    __m256i d = _mm256_setzero_si256();
    for (int64_t h = 0; h < 64; h += 32) {
      const __m256i uv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wu + b * 64 + h));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + b * 64 + h));
      d = _mm256_add_epi32(d, dot_u8s8(uv, xv));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(x.scale[b]), acc);
    correction += 128.f * x.scaled_sum[b];
  }
  return hsum256(acc) - correction;
#elif defined(__AVX2__)
  (void)wu;
  __m256 acc = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < K / 64; ++b) {
    __m256i d = _mm256_setzero_si256();
    for (int64_t h = 0; h < 64; h += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 64 + h));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + b * 64 + h));
      // |w| (unsigned: -128 gives 128) times sign(w) * x (|x| <= 127): a pair sums to at most 2 * 128 * 127 < 2^15,
      // so the 16-bit sums never saturate. (|x| times sign(x) * w would break on w = -128.)
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
      d = _mm256_add_epi32(d, _mm256_madd_epi16(p, ones));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(x.scale[b]), acc);
  }
  return hsum256(acc);
#else
  (void)wu;
  float total = 0.f;
  for (int64_t b = 0; b < K / 64; ++b) {
    int32_t d = 0;
    for (int64_t k = 0; k < 64; ++k) d += static_cast<int32_t>(w[b * 64 + k]) * x.q[b * 64 + k];
    total += static_cast<float>(d) * x.scale[b];
  }
  return total;
#endif
}

std::vector<QuantRow> quantize_rows(const at::Tensor& xf, int64_t block) {
  const int64_t M = xf.size(0), K = xf.size(1);
  std::vector<QuantRow> rows;
  rows.reserve(M);
  for (int64_t m = 0; m < M; ++m) rows.push_back(quantize_row(xf.data_ptr<float>() + m * K, K, block));
  return rows;
}

constexpr int64_t ROWS_PER_TASK = 64;

}  // namespace

// y [M, N] fp32 = x [M, K] @ W^T, W int4 in the layout above; scale, zero fp32 [N, K / group].
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                     int64_t group) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && packed.size(1) * 2 == x.size(1), "tokq_native::int4_gemv: shapes");
  TORCH_CHECK(group % 32 == 0 && x.size(1) % group == 0, "tokq_native::int4_gemv: group must divide K, 32 | group");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat && zero.scalar_type() == at::kFloat,
              "tokq_native::int4_gemv: dtypes");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = packed.size(0), G = K / group;
  auto y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y;  // (the loops below read rows[0])
  auto rows = quantize_rows(xf, 32);
  for (auto& r : rows) add_group_sums(r, G, group / 32);
#if defined(TOKQ_VNNI512)
  if (K % 64 == 0)
    for (auto& r : rows) arrange_pairs(r, K);
#endif
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t quads = N / 4;
  at::parallel_for(0, quads, ROWS_PER_TASK / 4, [&](int64_t begin, int64_t end) {
    float out[4][4];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * 4;
      const uint8_t* w = wp + n * (K / 2);
#if defined(TOKQ_VNNI512)
      if (!rows[0].pair_q.empty()) {  // activation rows four at a time: each weight load unpacked once for them
        float* outs[4] = {out[0], out[1], out[2], out[3]};
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const QuantRow* xr[4] = {&rows[m0], &rows[std::min(m0 + 1, M - 1)], &rows[std::min(m0 + 2, M - 1)],
                                   &rows[std::min(m0 + 3, M - 1)]};
          const int64_t mb = std::min<int64_t>(4, M - m0);
          switch (mb) {
            case 4: int4_quad_vnni512<4>(w, K / 2, sp + n * G, zp + n * G, G, xr, K, group, outs); break;
            case 3: int4_quad_vnni512<3>(w, K / 2, sp + n * G, zp + n * G, G, xr, K, group, outs); break;
            case 2: int4_quad_vnni512<2>(w, K / 2, sp + n * G, zp + n * G, G, xr, K, group, outs); break;
            default: int4_quad_vnni512<1>(w, K / 2, sp + n * G, zp + n * G, G, xr, K, group, outs); break;
          }
          for (int64_t m = 0; m < mb; ++m)
            for (int r = 0; r < 4; ++r) yp[(m0 + m) * N + n + r] = out[m][r];
        }
        continue;
      }
#endif
      for (int64_t m = 0; m < M; ++m) {
        int4_rows4(w, K / 2, sp + n * G, zp + n * G, G, rows[m], K, group, out[0]);
        for (int r = 0; r < 4; ++r) yp[m * N + n + r] = out[0][r];
      }
    }
  });
  for (int64_t n = quads * 4; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      yp[m * N + n] = int4_row(wp + n * (K / 2), sp + n * G, zp + n * G, rows[m], K, group);
  return y;
}

std::string isa();

// ---- int4, tiled for VNNI (AVX-512): the layout the registry's int4 path uses on AVX-512 VNNI builds -------------
//
// Layout (pack_int4_tiled in native/__init__.py): N in tiles of 16 rows; per tile, per weight group, one unit of
// bytes: the group's blocks of 64 k (512 bytes each: 16 quads q of 4 consecutive k, k = 64 b + 4 q + i, for 16 rows
// n, as vpdpbusd wants its second operand, [n][i] in one 64-byte register, row n in lane n; quads q and q + 8 share
// bytes, q in the low nibble: byte (q, n, i) = u[q][n][i] | u[q + 8][n][i] << 4 for q < 8, u = code + 8), then the
// 16 rows' scales (bf16 where every scale of the layer is a bf16 value, as in a loaded checkpoint; else fp32), then
// their 16 offsets o = zero code + 8 (uint8). A tile is one contiguous stream, scales included, where the scales
// had been separate [G, N] fp32 arrays (2G strided streams per tile). One sweep of SmolLM2's 120 decoder GEMVs (g64,
// through more than L3), 1 EPYC (Zen 4) thread, the layouts interleaved over 15 rounds on a quiet machine: inline
// bf16 scales 1.13x the separate arrays (1.07-1.28x; 10% fewer bytes), inline fp32 1.04x (0.95-1.13x).
// The dot product runs "vertically": each instruction adds 4 products into each of the 16 rows' lanes, so
// a weight group accumulates in int32 with no horizontal sums, and a weight register is reused by every activation
// row. Per 1024 weights and activation row: 16 vpdpbusd (activations broadcast from memory), 2 conversions, 2 FMAs.
// W = (u - 8 - zero) * s = u s - o s: y[m, n] = sum_b s[g(b), n] * xs[m, b] * dot_b - sum_g o[g, n] s[g, n] *
// group_sum[m, g].
#if defined(TOKQ_VNNI512)
namespace {

constexpr int64_t TILE_N = 16;
constexpr int64_t TILE_BYTES = 512;  // one block: 16 rows x 64 k, 4 bits each
constexpr int64_t PREFETCH_BYTES = 4096;  // the tile stream this far ahead into L1
constexpr int64_t PREFETCH_L2_BYTES = 16384;  // and this far into L2

// A unit's size: its blocks, the 16 scales (scale_bytes each) and the 16 offsets.
inline int64_t unit_bytes(int64_t blocks_per_group, int64_t scale_bytes) {
  return blocks_per_group * TILE_BYTES + TILE_N * scale_bytes + TILE_N;
}

template <int MB, bool BF16_SCALES>
inline void int4_tile_vnni512(const uint8_t* tile, int64_t G, int64_t blocks_per_group, const QuantRow* const* xr,
                              float* const* out) {
  constexpr int64_t SCALE_BYTES = BF16_SCALES ? 2 : 4;
  const int64_t unit = unit_bytes(blocks_per_group, SCALE_BYTES), codes = blocks_per_group * TILE_BYTES;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 f[MB];
  for (int m = 0; m < MB; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* ub = tile + g * unit;
    const uint8_t* header = ub + codes;
    // the header's lines ahead (the blocks' loop below covers the codes' lines)
    _mm_prefetch(reinterpret_cast<const char*>(header + PREFETCH_BYTES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(header + PREFETCH_BYTES + TILE_N * (SCALE_BYTES + 1) - 1), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(header + PREFETCH_L2_BYTES), _MM_HINT_T1);
    __m512 ws;
    if (BF16_SCALES)
      ws = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header))), 16));
    else
      ws = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
    for (int64_t bb = 0; bb < blocks_per_group; ++bb) {
      const int64_t b = g * blocks_per_group + bb;
      const uint8_t* wb = ub + bb * TILE_BYTES;
      __m512i w[16];
      for (int j = 0; j < 8; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH_BYTES + j * 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wb + PREFETCH_L2_BYTES + j * 64), _MM_HINT_T1);
        const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(wb + j * 64));
        w[j] = _mm512_and_si512(v, mask);
        w[j + 8] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
      for (int m = 0; m < MB; ++m) {
        const int32_t* x32 = reinterpret_cast<const int32_t*>(xr[m]->q.data() + b * 64);
        // four int32 chains, not two: at one activation row the dot products are bound by vpdpbusd's latency
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
        for (int q = 0; q < 8; q += 2) {
          a0 = _mm512_dpbusd_epi32(a0, w[q], _mm512_set1_epi32(x32[q]));
          a1 = _mm512_dpbusd_epi32(a1, w[q + 8], _mm512_set1_epi32(x32[q + 8]));
          c0 = _mm512_dpbusd_epi32(c0, w[q + 1], _mm512_set1_epi32(x32[q + 1]));
          c1 = _mm512_dpbusd_epi32(c1, w[q + 9], _mm512_set1_epi32(x32[q + 9]));
        }
        a0 = _mm512_add_epi32(a0, c0);
        a1 = _mm512_add_epi32(a1, c1);
        const float* xs = xr[m]->scale.data() + 2 * b;
        f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), _mm512_mul_ps(ws, _mm512_set1_ps(xs[0])), f[m]);
        f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_mul_ps(ws, _mm512_set1_ps(xs[1])), f[m]);
      }
    }
    const __m512 offsets = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + TILE_N * SCALE_BYTES))));
    const __m512 os = _mm512_mul_ps(offsets, ws);  // exact: a small integer times a scale
    for (int m = 0; m < MB; ++m) f[m] = _mm512_fnmadd_ps(os, _mm512_set1_ps(xr[m]->group_sum[g]), f[m]);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out[m], f[m]);
}

template <bool BF16_SCALES>
void int4_tiles(const uint8_t* wp, int64_t tiles, int64_t G, int64_t blocks_per_group, int64_t tile_bytes,
                const std::vector<QuantRow>& rows, float* yp, int64_t N) {
  const int64_t M = static_cast<int64_t>(rows.size());
  constexpr int64_t MBLOCK = 8;  // activation rows per pass: 16 weight registers + 8 accumulators fit in 32
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = wp + t * tile_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t mb = std::min(MBLOCK, M - m0);
        const QuantRow* xr[MBLOCK];
        float* outs[MBLOCK];
        for (int64_t m = 0; m < MBLOCK; ++m) {
          xr[m] = &rows[std::min(m0 + m, M - 1)];
          outs[m] = yp + std::min(m0 + m, M - 1) * N + t * TILE_N;
        }
        switch (mb) {
          case 8: int4_tile_vnni512<8, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 7: int4_tile_vnni512<7, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 6: int4_tile_vnni512<6, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 5: int4_tile_vnni512<5, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 4: int4_tile_vnni512<4, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 3: int4_tile_vnni512<3, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          case 2: int4_tile_vnni512<2, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
          default: int4_tile_vnni512<1, BF16_SCALES>(tile, G, blocks_per_group, xr, outs); break;
        }
      }
    }
  });
}

}  // namespace
#endif

// y [M, N] fp32 = x [M, K] @ W^T, W int4 in the tiled layout above: packed uint8 [N / 16, G, unit], unit = group / 64
// blocks of 512 bytes + 16 scales of 2 (bf16) or 4 (fp32) bytes + 16 offsets; N a multiple of 16, the group of 64.
at::Tensor int4_gemv_tiled(const at::Tensor& x, const at::Tensor& packed, int64_t group) {
#if defined(TOKQ_VNNI512)
  const char* op = "tokq_native::int4_gemv_tiled";
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && group % 64 == 0 && x.size(1) % group == 0, op,
              ": x [M, K], packed [N / 16, K / group, unit], 64 | group | K");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * TILE_N, G = K / group, bpg = group / 64;
  const int64_t unit = packed.size(2);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) == G, op,
              ": packed must be a contiguous uint8 [N / 16, ", G, ", unit]");
  TORCH_CHECK(unit == unit_bytes(bpg, 2) || unit == unit_bytes(bpg, 4), op, ": a unit of ", unit,
              " bytes is neither bf16 (", unit_bytes(bpg, 2), ") nor fp32 (", unit_bytes(bpg, 4), ") scales");
  const auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y;
  auto rows = quantize_rows(xf, 32);
  for (auto& r : rows) add_group_sums(r, G, group / 32);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (unit == unit_bytes(bpg, 2))
    int4_tiles<true>(wp, N / TILE_N, G, bpg, G * unit, rows, y.data_ptr<float>(), N);
  else
    int4_tiles<false>(wp, N / TILE_N, G, bpg, G * unit, rows, y.data_ptr<float>(), N);
  return y;
#else
  TORCH_CHECK(false, "tokq_native::int4_gemv_tiled needs an AVX-512 VNNI build (this one: ", isa(), ")");
#endif
}

// y [M, N] fp32 = x [M, K] @ (q * scale[:, None])^T; q int8 [N, K]; qu uint8 [N, K] (q + 128) on VNNI builds, else
// may be empty.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& qu, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && q.size(1) % 64 == 0,
              "tokq_native::int8_gemv: x [M, K], q [N, K], 64 | K");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = q.size(0);
  auto y = at::empty({M, N}, xf.options());
  auto rows = quantize_rows(xf, 64);
  for (auto& r : rows) add_group_sums(r, 1, K / 64);  // the +128 correction's sum, once per row, not per weight quad
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint8_t* up = qu.numel() ? qu.data_ptr<uint8_t>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0 || N == 0) return y;
#if defined(TOKQ_VNNI512)
  if (up != nullptr) {  // four weight rows at a time, each load shared by up to four activation rows
    const int64_t quads = N / 4;
    at::parallel_for(0, quads, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
      float out[4][4];
      float* outs[4] = {out[0], out[1], out[2], out[3]};
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n = b * 4;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const QuantRow* xr[4] = {&rows[m0], &rows[std::min(m0 + 1, M - 1)], &rows[std::min(m0 + 2, M - 1)],
                                   &rows[std::min(m0 + 3, M - 1)]};
          const int64_t mb = std::min<int64_t>(4, M - m0);
          switch (mb) {
            case 4: int8_quad_vnni512<4>(up + n * K, K, xr, outs); break;
            case 3: int8_quad_vnni512<3>(up + n * K, K, xr, outs); break;
            case 2: int8_quad_vnni512<2>(up + n * K, K, xr, outs); break;
            default: int8_quad_vnni512<1>(up + n * K, K, xr, outs); break;
          }
          for (int64_t m = 0; m < mb; ++m)
            for (int r = 0; r < 4; ++r) yp[(m0 + m) * N + n + r] = sp[n + r] * out[m][r];
        }
      }
    });
    for (int64_t n = quads * 4; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = sp[n] * int8_row(qp + n * K, up + n * K, rows[m], K);
    return y;
  }
#endif
  at::parallel_for(0, N, ROWS_PER_TASK * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + n] = sp[n] * int8_row(qp + n * K, up ? up + n * K : nullptr, rows[m], K);
  });
  return y;
}

namespace {

// bf16 [K] as fp32 into `out` (bf16 is the top half of an fp32)
inline void bf16_to_float(const uint16_t* src, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(out + i, &bits, sizeof(float));
  }
}

// How far ahead of the four rows being read bf16_rows4 prefetches the weights, which lie as one contiguous stream:
// into L1 BF16_PREFETCH_BYTES on, into L2 BF16_PREFETCH_L2_BYTES on (and each task's first BF16_PREFETCH_L2_BYTES
// before it starts). The four rows are read side by side, four short streams of 2K bytes each, which this CPU's own
// stream prefetch does not catch up with. Measured on a 2-core EPYC (Zen 4), weights cycled through more than L3,
// one sweep of SmolLM2-135M's 120 decoder GEMVs (median of 7): 1 thread 14.3-16.5 GB/s with the L1 prefetch alone,
// 17.3-19.7 with both (no prefetch: 8-14 GB/s per shape); 2 threads 26.3 -> 32.1 GB/s. 2 KB to 16 KB ahead for L1
// were within noise of each other.
constexpr int64_t BF16_PREFETCH_BYTES = 4096;
constexpr int64_t BF16_PREFETCH_L2_BYTES = 16384;

// Four consecutive bf16 rows against one activation row (bf16 xb, and as fp32 xf): fp32 accumulation. `prefetch`:
// when not null, the weights at the same place in the stream BF16_PREFETCH_BYTES on are fetched, as many lines as the
// four rows hold (null on the second and later activation rows, whose weights are already in cache).
inline void bf16_rows4(const uint16_t* w, int64_t K, const uint16_t* xb, const float* xf, float* out,
                       const char* prefetch) {
  int64_t k = 0;
  float tail[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // vdpbf16ps: 32 bf16 products per row per instruction, pairs summed in fp32
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; k + 32 <= K; k += 32) {
    const __m512i xv = _mm512_loadu_si512(reinterpret_cast<const void*>(xb + k));
    if (prefetch)  // 4 rows x 64 bytes read per step: 4 lines of the stream ahead (past its end never faults)
      for (int r = 0; r < 4; ++r) {
        _mm_prefetch(prefetch + (k / 32 * 4 + r) * 64, _MM_HINT_T0);
        _mm_prefetch(prefetch + (BF16_PREFETCH_L2_BYTES - BF16_PREFETCH_BYTES) + (k / 32 * 4 + r) * 64, _MM_HINT_T1);
      }
    for (int r = 0; r < 4; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + r * K + k)),
                                (__m512bh)xv);
  }
  for (int r = 0; r < 4; ++r) tail[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(xf + k);
    if (prefetch) {  // 4 rows x 16 bytes per step: one line
      _mm_prefetch(prefetch + k / 8 * 64, _MM_HINT_T0);
      _mm_prefetch(prefetch + (BF16_PREFETCH_L2_BYTES - BF16_PREFETCH_BYTES) + k / 8 * 64, _MM_HINT_T1);
    }
    for (int r = 0; r < 4; ++r) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k));
      const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
    }
  }
  for (int r = 0; r < 4; ++r) tail[r] = hsum256(acc[r]);
#endif
  (void)xb;
  (void)prefetch;
  for (int r = 0; r < 4; ++r) {
    float s = tail[r];
    for (int64_t kk = k; kk < K; ++kk) {
      const uint32_t bits = static_cast<uint32_t>(w[r * K + kk]) << 16;
      float wf;
      std::memcpy(&wf, &bits, sizeof(float));
      s += wf * xf[kk];
    }
    out[r] = s;
  }
}

}  // namespace

// Rows up to which bf16_gemv runs its own loop; above, at::linear. Measured on a 2-core Xeon (AVX512-BF16, 1 thread,
// best of 6, weights cycled through L3): SmolLM2's qkv [960, 576] 45 / 98 / 145 us at M = 1 / 2 / 4 against 102 /
// 154 / 153 us for F.linear, gate_up [3072, 576] 314 / 479 / 658 against 438 / 583 / 652, the tied LM head
// [49152, 576] 7.6 / 7.1 / 8.8 ms against 10.1 / 7.0 / 7.3 ms; at M = 16 F.linear is 2.5-3x faster.
constexpr int64_t BF16_GEMV_MAX_M = 2;

// y [M, N] bf16 = x [M, K] bf16 @ w [N, K]^T bf16, fp32 accumulation; the weights read once per call. More than
// BF16_GEMV_MAX_M rows: at::linear, so that one compiled graph serves every batch size.
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "tokq_native::bf16_gemv: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "tokq_native::bf16_gemv: bf16 x and w");
  if (x.size(0) > BF16_GEMV_MAX_M) return at::linear(x, w);  // torch's GEMM (AMX/oneDNN) wins from ~4 rows on
  const auto xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = at::empty({M, N}, xc.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  std::vector<float> xf(M * K);
  bf16_to_float(xp, xf.data(), M * K);
  const int64_t quads = (N + 3) / 4;
  at::parallel_for(0, quads, ROWS_PER_TASK / 4, [&](int64_t begin, int64_t end) {
    float out[4];
    std::vector<uint16_t> pad;  // the last quad when N % 4: its missing rows as zeros
    const char* start = reinterpret_cast<const char*>(wp + begin * 4 * K);  // this task's first lines, into L2
    for (int64_t o = 0; o < std::min(BF16_PREFETCH_L2_BYTES, (end - begin) * 8 * K); o += 64)
      _mm_prefetch(start + o, _MM_HINT_T1);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * 4, rows = std::min<int64_t>(4, N - n);
      const uint16_t* wq = wp + n * K;
      if (rows < 4) {
        pad.assign(4 * K, 0);
        std::copy(wq, wq + rows * K, pad.begin());
        wq = pad.data();
      }
      const char* ahead = rows < 4 ? nullptr : reinterpret_cast<const char*>(wq) + BF16_PREFETCH_BYTES;
      for (int64_t m = 0; m < M; ++m) {
        bf16_rows4(wq, K, xp + m * K, xf.data() + m * K, out, m == 0 ? ahead : nullptr);
        for (int64_t r = 0; r < rows; ++r) yp[m * N + n + r] = at::BFloat16(out[r]);
      }
    }
  });
  return y;
}

std::string isa() {
#if defined(TOKQ_VNNI512)
  return "avx512+vnni";
#elif defined(TOKQ_VNNI256)
  return "avx2+vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

TORCH_LIBRARY(tokq_native, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group) -> Tensor");
  m.def("int4_gemv_tiled(Tensor x, Tensor packed, int group) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor q, Tensor qu, Tensor scale) -> Tensor");
  m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(tokq_native, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_tiled", &int4_gemv_tiled);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("bf16_gemv", &bf16_gemv);
}
