// tokq's native paged attention for decode steps on CPU, built with gemv.cpp into one library (native/__init__.py).
//
// A decode step asks, per layer, for one query token per sequence against that sequence's keys in the paged cache.
// torch's SDPA kernels are built for long queries: for one query token they cost ~120 us a call on SmolLM2's heads
// (600 keys), most of it fixed overhead, plus the Python around them. This reads the keys and values in place
// through the block table (no gather), in fp32, split over (sequence, KV head, chunk of keys) so that two threads
// share even a single short sequence, and merges the chunks exactly by their log-sum-exp (flash-decoding).
//
// Layouts (kernels/paged.py): caches [num_blocks, block_size, kv_heads, head_dim] in the queries' float dtype;
// block_tables int32 [B, width]; seq_lens int32 [B]; query_start_loc int32 [B + 1] (decode: 0, 1, ..., B); q and
// the output [B, heads, head_dim]. Every block id a sequence uses and every slot written is bounds-checked here,
// before anything is read or written, so untrusted metadata raises instead of reading out of bounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t KEYS_PER_TASK = 128;  // keys one task scores: several tasks for 2 threads at batch 1
constexpr int64_t MERGE_GRAIN = 64;  // (sequence, head) pairs below which the merge runs on the calling thread

template <typename T>
inline void load_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the top half of an fp32: a shift, which the compiler vectorizes (the c10 conversion it does not)
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

#if defined(__AVX512F__)
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

// Explicit vectors: `omp simd reduction` ends each dot product with a serial chain of 16 scalar adds, which made
// scoring 4x slower than these tree reductions.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    s = hsum(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = hsum(acc);
  }
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x for x <= 0 (scores minus their maximum): 2^(x log2 e) split into 2^n (exponent bits) times 2^r, |r| <= 1/2,
// by a degree-6 Taylor polynomial (relative error ~1e-7). The same steps in scalar, AVX2 and AVX-512 form.
constexpr float EXP_C[7] = {1.0f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                            9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381606e-4f};
constexpr float LOG2E = 1.4426950408889634f;

inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * LOG2E;
  const float n = std::floor(t + 0.5f), r = t - n;
  float p = EXP_C[6];
  for (int c = 5; c >= 0; --c) p = p * r + EXP_C[c];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

#if defined(__AVX512F__)
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(EXP_C[6]);
  for (int c = 5; c >= 0; --c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[c]));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(LOG2E));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(EXP_C[6]);
  for (int c = 5; c >= 0; --c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[c]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

inline float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + i));
  m = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (float lane : lanes) m = std::max(m, lane);
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// s[i] = e^(s[i] - m) in place; returns their sum
inline float exp_shifted_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(m)));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = hsum(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m)));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// The caches are read from memory, not cache, in a decode step (the weights streamed between layers evict them):
// 460 KB a layer for SmolLM2 at 600 keys took 137 us read that way against 78 us from L3. The hardware prefetcher
// stops at 4 KB pages and a key's slot is 384 bytes; asking for the slot PREFETCH_KEYS keys ahead keeps several
// misses in flight.
constexpr int64_t PREFETCH_KEYS = 8;

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

template <typename T>
inline void prefetch_l2(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

struct Chunk {
  int64_t seq, lo, hi;  // keys [lo, hi) of sequence `seq`
};

// Each sequence's keys [start, len) split into chunks of at most KEYS_PER_TASK, one task each, merged afterwards
// by their log-sum-exp. With fewer tasks than a few per thread (batch 1), a sequence's chunk count is rounded up to
// a multiple of the threads, so that every thread gets the same number of keys: 600 keys made 5 chunks of 128,
// three for one thread and two for the other.
std::vector<Chunk> plan_chunks(const std::vector<int64_t>& starts, const std::vector<int64_t>& lens,
                               std::vector<int64_t>& first_chunk) {
  const int64_t B = static_cast<int64_t>(lens.size()), threads = at::get_num_threads();
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += (lens[b] - starts[b] + KEYS_PER_TASK - 1) / KEYS_PER_TASK;
  const bool balance = threads > 1 && total < 4 * threads;
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < B; ++b) {
    first_chunk[b] = static_cast<int64_t>(chunks.size());
    const int64_t keys = lens[b] - starts[b];
    int64_t count = (keys + KEYS_PER_TASK - 1) / KEYS_PER_TASK;
    if (balance) count = std::min(keys, (count + threads - 1) / threads * threads);
    for (int64_t c = 0; c < count; ++c)  // chunk c: keys [keys c / count, keys (c + 1) / count), sizes differ by <= 1
      chunks.push_back({b, starts[b] + keys * c / count, starts[b] + keys * (c + 1) / count});
  }
  first_chunk[B] = static_cast<int64_t>(chunks.size());
  return chunks;
}

// Per thread: buffers one chunk's work needs.
struct ChunkScratch {
  std::vector<float> qf, row, rows, scores, acc;
  std::vector<int64_t> offsets;
  std::vector<uint16_t> zero_slot;  // a key of zeros: what the bf16 path scores in place of keys past a chunk's end
  ChunkScratch(int64_t Hq, int64_t D, int64_t slot)
      : qf(Hq * D), row(slot), rows(4 * slot), scores(Hq * KEYS_PER_TASK), acc(Hq * D), offsets(KEYS_PER_TASK),
        zero_slot(slot, 0) {}
};

// One chunk, any dtype and instruction set: each key's slot ([kv_heads, head_dim], contiguous) converted to fp32
// once for every head. Writes part[head * (D + 2) + {0: max score, 1: sum of exp, 2..: unnormalized output}].
template <typename T>
void decode_chunk(const Chunk& c, const T* qp, const T* kp, const T* vp, int64_t Hq, int64_t Hkv, int64_t D,
                  float scale, ChunkScratch& w, float* part) {
  const int64_t G = Hq / Hkv, slot = Hkv * D, stride = D + 2, n = c.hi - c.lo;
  const int64_t* offsets = w.offsets.data();
  float* scores = w.scores.data();
  load_float(qp + c.seq * Hq * D, w.qf.data(), Hq * D);
  for (int64_t i = 0; i < n; ++i) {
    if (i + PREFETCH_KEYS < n) prefetch(kp + offsets[i + PREFETCH_KEYS], slot);
    load_float(kp + offsets[i], w.row.data(), slot);
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        scores[(h * G + g) * KEYS_PER_TASK + i] = scale * dot(w.qf.data() + (h * G + g) * D, w.row.data() + h * D, D);
  }
  for (int64_t head = 0; head < Hq; ++head) {
    float* s = scores + head * KEYS_PER_TASK;
    const float m = max_of(s, n);
    part[head * stride] = m;
    part[head * stride + 1] = exp_shifted_sum(s, n, m);
  }
  // the weighted sum of values, four keys per pass over the accumulators: one load and store of each
  // accumulator per four keys (one per key made those stores the kernel's bottleneck)
  float* rows = w.rows.data();
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t keys = std::min<int64_t>(4, n - i0);
    for (int64_t j = 0; j < 4; ++j) {
      if (i0 + j + PREFETCH_KEYS < n) prefetch(vp + offsets[i0 + j + PREFETCH_KEYS], slot);
      if (j < keys) load_float(vp + offsets[i0 + j], rows + j * slot, slot);
      else std::fill(rows + j * slot, rows + (j + 1) * slot, 0.f);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* v0 = rows + h * D;
      const float* v1 = v0 + slot;
      const float* v2 = v1 + slot;
      const float* v3 = v2 + slot;
      for (int64_t g = 0; g < G; ++g) {
        const float* sc = scores + (h * G + g) * KEYS_PER_TASK + i0;
        const float p0 = sc[0], p1 = keys > 1 ? sc[1] : 0.f, p2 = keys > 2 ? sc[2] : 0.f, p3 = keys > 3 ? sc[3] : 0.f;
        float* a = w.acc.data() + (h * G + g) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
      }
    }
  }
  for (int64_t head = 0; head < Hq; ++head)
    std::copy(w.acc.begin() + head * D, w.acc.begin() + (head + 1) * D, part + head * stride + 2);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 caches on AVX-512 BF16 (head_dim a multiple of 64): the generic chunk spent ~360 instructions a key (fp32
// conversion of every slot, a horizontal sum per score, accumulators through memory), 65 us a SmolLM2 layer at
// 600 keys, compute-bound at a third of the memory bandwidth. Here a score is vdpbf16ps straight on the cached
// bf16 (products exact in fp32) with 16 keys' sums reduced together (transpose_sum16), and the values accumulate
// in registers, 4 query heads x 64 dims at a time.
constexpr bool kBf16Path = true;

// lane j of the result = the sum of v[j]'s 16 lanes
inline __m512 transpose_sum16(__m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)  // per 128-bit lane: the lane's sums of 4 vectors
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 bf16x16_to_float(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 keys' scores against one query head, scaled, into out (masked to the valid keys). PAIRS = head_dim / 32, a
// template parameter so that the 16 accumulators stay in registers as 16 independent vdpbf16ps chains: with a
// runtime inner loop the compiler kept them in memory and ran one key's chain after another, latency-bound
// (~135 cycles a key for SmolLM2's 9 heads, perf annotate).
template <int PAIRS>
inline void score16(const uint16_t* qh, const uint16_t* const* keys, __m512 vscale, float* out, __mmask16 valid) {
  __m512bh qv[PAIRS];
  for (int p = 0; p < PAIRS; ++p) qv[p] = (__m512bh)_mm512_loadu_si512(qh + 32 * p);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int p = 0; p < PAIRS; ++p)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv[p], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * p));
  }
  _mm512_mask_storeu_ps(out, valid, _mm512_mul_ps(transpose_sum16(acc), vscale));
}

void decode_chunk_bf16(const Chunk& c, const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, int64_t Hq,
                       int64_t Hkv, int64_t D, float scale, ChunkScratch& w, float* part) {
  const int64_t G = Hq / Hkv, slot = Hkv * D, stride = D + 2, n = c.hi - c.lo, pairs = D / 32;
  const int64_t* offsets = w.offsets.data();
  float* scores = w.scores.data();
  const uint16_t* q = qp + c.seq * Hq * D;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < std::min<int64_t>(16, n); ++j) {
    prefetch(kp + offsets[j], slot);
    prefetch_l2(vp + offsets[j], slot);
  }
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - i0);
    // the next 16 keys' slots into L1, and this block's values into L2 for the pass below
    for (int64_t j = i0 + 16; j < std::min(n, i0 + 32); ++j) {
      prefetch(kp + offsets[j], slot);
      prefetch_l2(vp + offsets[j], slot);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << keys) - 1);
    if (pairs == 2 || pairs == 4 || pairs == 8) {
      for (int64_t h = 0; h < Hkv; ++h) {
        const uint16_t* kh[16];
        for (int64_t j = 0; j < 16; ++j) kh[j] = (j < keys ? kp + offsets[i0 + j] : w.zero_slot.data()) + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const uint16_t* qh = q + (h * G + g) * D;
          float* out = scores + (h * G + g) * KEYS_PER_TASK + i0;
          if (pairs == 2) score16<2>(qh, kh, vscale, out, valid);
          else if (pairs == 4) score16<4>(qh, kh, vscale, out, valid);
          else score16<8>(qh, kh, vscale, out, valid);
        }
      }
      continue;
    }
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* qh = q + (h * G + g) * D;
        __m512 acc[16];
        for (int64_t j = 0; j < 16; ++j) {
          acc[j] = _mm512_setzero_ps();
          if (j >= keys) continue;
          const uint16_t* k = kp + offsets[i0 + j] + h * D;
          for (int64_t p = 0; p < pairs; ++p)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(qh + 32 * p),
                                      (__m512bh)_mm512_loadu_si512(k + 32 * p));
        }
        _mm512_mask_storeu_ps(scores + (h * G + g) * KEYS_PER_TASK + i0, valid,
                              _mm512_mul_ps(transpose_sum16(acc), vscale));
      }
  }
  for (int64_t head = 0; head < Hq; ++head) {
    float* s = scores + head * KEYS_PER_TASK;
    const float m = max_of(s, n);
    part[head * stride] = m;
    part[head * stride + 1] = exp_shifted_sum(s, n, m);
  }
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t d0 = 0; d0 < D; d0 += 64)
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t heads = std::min<int64_t>(4, G - g0);
        __m512 acc[4][4];
        for (auto& a : acc)
          for (auto& x : a) x = _mm512_setzero_ps();
        const float* sc = scores + (h * G + g0) * KEYS_PER_TASK;
        const bool first_pass = h == 0 && d0 == 0 && g0 == 0;
        for (int64_t i = 0; i < n; ++i) {
          if (first_pass && i + PREFETCH_KEYS < n) prefetch(vp + offsets[i + PREFETCH_KEYS], slot);
          const uint16_t* v = vp + offsets[i] + h * D + d0;
          const __m512 v0 = bf16x16_to_float(v), v1 = bf16x16_to_float(v + 16), v2 = bf16x16_to_float(v + 32),
                       v3 = bf16x16_to_float(v + 48);
          for (int64_t g = 0; g < 4; ++g) {
            if (g >= heads) break;
            const __m512 p = _mm512_set1_ps(sc[g * KEYS_PER_TASK + i]);
            acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
          }
        }
        for (int64_t g = 0; g < heads; ++g) {
          float* out = part + (h * G + g0 + g) * stride + 2 + d0;
          for (int64_t x = 0; x < 4; ++x) _mm512_storeu_ps(out + 16 * x, acc[g][x]);
        }
      }
}
#else
constexpr bool kBf16Path = false;
#endif

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const int32_t* tables, int64_t width, const std::vector<int64_t>& starts,
                      const std::vector<int64_t>& lens, double scale_d, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), slot = Hkv * D;
  const float scale = static_cast<float>(scale_d);
  std::vector<int64_t> first_chunk(B + 1);
  const std::vector<Chunk> chunks = plan_chunks(starts, lens, first_chunk);
  // per (chunk, query head): the chunk's max score, its sum of exp, and its unnormalized output [D]
  const int64_t stride = D + 2;
  std::vector<float> partial(static_cast<size_t>(chunks.size() * Hq * stride));
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const bool bf16_path = kBf16Path && std::is_same<T, c10::BFloat16>::value && D % 64 == 0;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    ChunkScratch scratch(Hq, D, slot);
    for (int64_t task = begin; task < end; ++task) {
      const Chunk c = chunks[task];
      for (int64_t pos = c.lo; pos < c.hi; ++pos)
        scratch.offsets[pos - c.lo] = (static_cast<int64_t>(tables[c.seq * width + pos / BS]) * BS + pos % BS) * slot;
      float* part = partial.data() + task * Hq * stride;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if (bf16_path) {
        decode_chunk_bf16(c, reinterpret_cast<const uint16_t*>(qp), reinterpret_cast<const uint16_t*>(kp),
                          reinterpret_cast<const uint16_t*>(vp), Hq, Hkv, D, scale, scratch, part);
        continue;
      }
#endif
      decode_chunk(c, qp, kp, vp, Hq, Hkv, D, scale, scratch, part);
    }
  });
  // merge each sequence's chunks: softmax over the union = chunks weighted by e^(max_c - max). A few microseconds
  // at batch 1, less than waking the other threads would cost: parallel only from MERGE_GRAIN (sequence, head)s.
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * Hq, MERGE_GRAIN, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hq, head = bh % Hq;
      float m = -INFINITY;
      for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c)
        m = std::max(m, partial[(c * Hq + head) * stride]);
      float total = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; ++c) {
        const float* part = partial.data() + (c * Hq + head) * stride;
        const float w = std::exp(part[0] - m);
        total += w * part[1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[2 + d];
      }
      T* dst = op + bh * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] / total);
    }
  });
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, c10::ScalarType dtype, const char* op) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype, op,
              ": the caches must have the queries' (or new keys') dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op, ": the caches must be contiguous");
}

}  // namespace

// out [B, Hq, D] = attention of each sequence's one query q[b] over its keys [start, seq_len) in the paged cache,
// start = max(0, seq_len - window) with a sliding window (window > 0), else 0.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        double scale, int64_t window) {
  const char* op = "tokq_native::paged_decode";
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), op, ": q must be a contiguous [B, heads, head_dim]");
  check_cache(k_cache, v_cache, q.scalar_type(), op);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, op, ": head dims must match and heads divide by KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(), op, ": block_tables must be a contiguous int32 [B, width]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == B && seq_lens.scalar_type() == at::kInt, op,
              ": seq_lens must be int32 [B]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == B + 1 &&
                  query_start_loc.scalar_type() == at::kInt, op, ": query_start_loc must be int32 [B + 1]");
  TORCH_CHECK(scale > 0, op, ": the softmax scale must be > 0");
  const int64_t width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const auto lens32 = seq_lens.contiguous();
  const auto qsl = query_start_loc.contiguous();
  std::vector<int64_t> starts(B), lens(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qsl.data_ptr<int32_t>()[b + 1] - qsl.data_ptr<int32_t>()[b] == 1, op,
                ": decode only (one query per sequence); sequence ", b, " has another count");
    const int64_t len = lens32.data_ptr<int32_t>()[b];
    TORCH_CHECK(len >= 1 && len <= width * BS, op, ": sequence ", b, " has seq_len ", len, ", outside [1, ",
                width * BS, "] (its block table's capacity)");
    lens[b] = len;
    starts[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t blk = starts[b] / BS; blk <= (len - 1) / BS; ++blk) {
      const int64_t id = tables[b * width + blk];
      TORCH_CHECK(id >= 0 && id < NB, op, ": sequence ", b, " names block ", id, ", outside the cache's ", NB,
                  " blocks");
    }
  }
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: decode_attention<float>(q, k_cache, v_cache, tables, width, starts, lens, scale, out); break;
    case at::kBFloat16:
      decode_attention<c10::BFloat16>(q, k_cache, v_cache, tables, width, starts, lens, scale, out);
      break;
    case at::kHalf: decode_attention<c10::Half>(q, k_cache, v_cache, tables, width, starts, lens, scale, out); break;
    default: TORCH_CHECK(false, op, ": q must be fp32, bf16 or fp16");
  }
  return out;
}

// k/v [T, Hkv, D] into the caches at `slots` (int64 [T]; < 0: padding, skipped). Every slot is checked before any
// is written, so a bad one leaves the caches as they were.
void paged_write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slots) {
  const char* op = "tokq_native::paged_write";
  check_cache(k_cache, v_cache, k.scalar_type(), op);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              op, ": k and v must both be [T, kv_heads, head_dim] to match the cache");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), op, ": k and v must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong, op,
              ": slots must be int64 [T]");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1), T = k.size(0);
  const auto kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous();
  const int64_t* s = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] < capacity, op, ": slot ", s[t], " is outside the cache (", capacity, " slots)");
  const int64_t row = kc.size(1) * kc.size(2) * kc.element_size();
  const char* ks = static_cast<const char*>(kc.data_ptr());
  const char* vs = static_cast<const char*>(vc.data_ptr());
  char* kd = static_cast<char*>(k_cache.data_ptr());
  char* vd = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    std::memcpy(kd + s[t] * row, ks + t * row, row);
    std::memcpy(vd + s[t] * row, vs + t * row, row);
  }
}

// One decode step of one layer: the new keys/values written (paged_write), then the attention (paged_decode). The
// op a compiled decode step calls straight from its graph (engine/compiled_decode.py), so that a layer's attention
// costs no Python. Its schema declares no mutation, like tokq::paged_attend's: the caches are read by nothing in
// the graph but these ops, and each layer's call depends on the layer before.
at::Tensor paged_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                             int64_t window) {
  paged_write(k, v, k_cache, v_cache, slots);
  return paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window);
}

TORCH_LIBRARY_FRAGMENT(tokq_native, m) {
  m.def("paged_decode_step(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int window) -> Tensor");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int window) -> Tensor");
  m.def("paged_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokq_native, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_write", &paged_write);
  m.impl("paged_decode_step", &paged_decode_step);
}
