// A whole decode step of a Llama-family model in one C++ call: `torch.classes.tokq_native.LlamaDecoder`, built once
// per engine from the model's own tensors (no copies) and the engine's paged caches (engine/native_step.py).
//
// Why: through torch.compile's graph, a SmolLM2 decode step at batch 1 spent 34% (1 thread) to 42% (2 threads) of its
// time outside tokq's kernels (benchmarks/decode_profile.py): the wrapper's Python calling ~150 ops and ~120 fused
// pointwise loops a step, dynamo's guards and the pre-graph bytecode. Here the step is a C++ loop over the layers
// calling the same kernels (gemv.cpp's GEMVs, attention.cpp's paged_decode_step) directly, with the small pointwise
// work (RMSNorm, RoPE, SwiGLU, residuals) written out.
//
// The pointwise work rounds to bf16 where the eager PyTorch model does (each op's result is a bf16 tensor there), so a
// step matches the eager path's up to the order of a few fp32 sums: RMSNorm normalizes in fp32, rounds, then
// multiplies by the weight (Llama's order); RoPE rounds x*cos, rotate(x)*sin and their sum; SiLU and the gate
// product are rounded separately; residual adds round once.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                     int64_t group);
at::Tensor int4_gemv_tiled(const at::Tensor& x, const at::Tensor& packed, int64_t group);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& qu, const at::Tensor& scale);
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w);
at::Tensor paged_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                             at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                             int64_t window);

namespace {

using bf16 = c10::BFloat16;

// How a linear layer computes (engine/native_step.py's constants name them): the kernel its registry picked, which
// takes up to `max_rows` rows; more rows go where the Python kernels send them (kernels/cpu/linear.py,
// native_linear.py): int4 weights dequantized to bf16 for a dense GEMM, int8 weights through aten's int8pack op.
enum LinearKind : int64_t {
  DENSE_BF16 = 0,  // a: weight bf16 [N, K] (bf16_gemv hands more than 2 rows to at::linear itself)
  INT4_TILED = 1,  // a: packed [N_pad/16, G, unit] (gemv.cpp's tiled layout, scales inside), b, c: empty
  INT4_ROWS = 2,   // a: packed [N, K/2], b: scale, c: zero (fp32 [N, G])
  INT8 = 3,        // a: q int8 [N, K], b: q + 128 uint8 (VNNI builds) or empty, c: scale fp32 [N]; dq_scale bf16 [N]
  ATEN_INT4 = 4,   // a: aten int4pack [N_pad, K/2], b: scales_and_zeros bf16 [G, N_pad, 2]
  ATEN_INT8 = 5,   // a: q int8 [N, K], b: scale bf16 [N]
};
// a, b, c, bias, input permutation, and the codes, scales and zero points the int4 kinds dequantize above max_rows
// (INT8: the bf16 scales for aten's op); empty tensors where absent
constexpr int64_t TENSORS_PER_LINEAR = 8;
constexpr int64_t META_PER_LINEAR = 4;    // kind, n, group, max_rows
constexpr int64_t LINEARS_PER_LAYER = 4;  // qkv, o, gate_up, down
constexpr int64_t KINDS = 6;
constexpr const char* NAMES[KINDS] = {"tokq_native::bf16_gemv", "tokq_native::int4_gemv_tiled", "tokq_native::int4_gemv",
                                      "tokq_native::int8_gemv", "tokq_native::aten_int4pack_linear",
                                      "tokq_native::aten_int8pack_linear"};

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The pointwise work in AVX-512, 16 values at a time (~0.4 ms of a SmolLM2 step at one thread in scalar code, where
// every bf16 rounding is a c10::BFloat16 conversion): the same roundings (to nearest even, as c10's), and an expf of
// Cephes' polynomial (within 2 ulp of std::exp). Elsewhere, and for tails, the scalar loops.
#if defined(__AVX512F__)
constexpr int64_t VEC = 16;
inline __m512 vload(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512i rne_bits(__m512 v) {  // fp32 bits + the rounding bias of bf16's round to nearest even
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
}
inline __m512 vround(__m512 v) {  // to bf16 precision, kept as fp32
  return _mm512_castsi512_ps(_mm512_and_si512(rne_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vstore(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rne_bits(v), 16)));
}
inline __m512 vexp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#else
constexpr int64_t VEC = 0;  // no vector path: every loop below runs its scalar tail from 0
#endif

struct NativeLinear {
  int64_t kind = DENSE_BF16, n = 0, group = 0, max_rows = 0;
  at::Tensor a, b, c, bias, perm, dq_q, dq_scale, dq_zero;
  std::vector<float> bias_f;  // the bias's bf16 values

  // W = (q - z) * s as bf16 [N, K], computed in fp32 (kernels/cpu/linear.py's dequantize_bf16)
  at::Tensor dequantized() const {
    const int64_t N = dq_q.size(0), K = dq_q.size(1), G = dq_scale.size(1);
    at::Tensor w = dq_q.view({N, G, K / G}).to(at::kFloat);
    if (dq_zero.defined()) w.sub_(dq_zero.unsqueeze(-1));
    return w.mul_(dq_scale.unsqueeze(-1)).view({N, K}).to(at::kBFloat16);
  }

  // x [M, K] bf16 -> [M, n] bf16, the bias added in bf16 (as kernels/cpu/linear.py's _finish does). xf: the same
  // values in fp32, which the integer GEMVs quantize from (passing it saves each of them a conversion op).
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& xf) const {
    const at::Tensor in = perm.defined() ? x.index_select(1, perm) : x;
    const at::Tensor& xin = perm.defined() ? in : xf;
    const bool fits = in.size(0) <= max_rows;
    // the kernels are called as C++ functions here, not through the dispatcher: named for torch's profiler
    // (benchmarks/decode_profile.py), a flag check when it is off
    RECORD_FUNCTION(fits ? NAMES[kind] : "tokq_native::linear_above_gemv_rows", c10::ArrayRef<const c10::IValue>{});
    at::Tensor y;
    switch (kind) {
      case DENSE_BF16: y = bf16_gemv(in, a); break;
      case INT4_TILED: y = fits ? int4_gemv_tiled(xin, a, group) : at::linear(in, dequantized()); break;
      case INT4_ROWS: y = fits ? int4_gemv(xin, a, b, c, group) : at::linear(in, dequantized()); break;
      case INT8: y = fits ? int8_gemv(xin, a, b, c) : at::_weight_int8pack_mm(in, a, dq_scale); break;
      case ATEN_INT4: y = fits ? at::_weight_int4pack_mm_for_cpu(in, a, group, b) : at::linear(in, dequantized()); break;
      default: y = at::_weight_int8pack_mm(in, a, b); break;
    }
    if (y.scalar_type() == at::kBFloat16 && y.size(1) == n && y.is_contiguous() && !bias.defined()) return y;
    // y [M, >= n] fp32 or bf16 -> bf16 [M, n], then + bias in bf16: written out rather than narrow / to / add_
    // (three dispatched ops and allocations a projection, ~120 a step)
    const int64_t M = y.size(0), stride = y.size(1);
    const at::Tensor yc = y.contiguous();
    at::Tensor out = at::empty({M, n}, x.options());
    bf16* op = out.data_ptr<bf16>();
    const bool is_float = yc.scalar_type() == at::kFloat;
    const float* yf = is_float ? yc.data_ptr<float>() : nullptr;
    const bf16* yb = is_float ? nullptr : yc.data_ptr<bf16>();
    const float* bp = bias_f.empty() ? nullptr : bias_f.data();
    for (int64_t m = 0; m < M; ++m) {
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + VEC <= n; j += VEC) {
        __m512 v = is_float ? vround(_mm512_loadu_ps(yf + m * stride + j)) : vload(yb + m * stride + j);
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + j));
        vstore(op + m * n + j, v);
      }
#endif
      for (; j < n; ++j) {
        float v = is_float ? static_cast<float>(bf16(yf[m * stride + j])) : static_cast<float>(yb[m * stride + j]);
        op[m * n + j] = bp ? bf16(v + bp[j]) : bf16(v);
      }
    }
    return out;
  }
};


// dst fp32 = src bf16 (exact), n values
void widen(const at::Tensor& src, at::Tensor& dst) {
  const bf16* s = src.data_ptr<bf16>();
  float* d = dst.data_ptr<float>();
  const int64_t n = src.numel();
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + VEC <= n; i += VEC) _mm512_storeu_ps(d + i, vload(s + i));
#endif
  for (; i < n; ++i) d[i] = static_cast<float>(s[i]);
}

// Llama's RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(bf16), the normalization in fp32.
void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const bf16* xr = x + m * H;
    float ss = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + VEC <= H; i += VEC) {
      const __m512 v = vload(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#endif
    for (; i < H; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    i = 0;
#if defined(__AVX512F__)
    for (; i + VEC <= H; i += VEC)
      vstore(out + m * H + i, _mm512_mul_ps(vload(w + i), vround(_mm512_mul_ps(vload(xr + i), _mm512_set1_ps(r)))));
#endif
    for (; i < H; ++i)
      out[m * H + i] = bf16(static_cast<float>(w[i]) * round_bf16(static_cast<float>(xr[i]) * r));
  }
}

// Rotate-half RoPE of `heads` heads of one token, src -> dst; cos/sin already rounded to bf16 (as the model's tables).
void rope(const bf16* src, bf16* dst, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const bf16* xh = src + h * D;
    bf16* out = dst + h * D;
    int64_t d = 0;
#if defined(__AVX512F__)
    if (half % VEC == 0)
      for (; d < half; d += VEC) {  // d in the first half, d + half in the second
        const __m512 lo = vload(xh + d), hi = vload(xh + d + half);
        const __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
        vstore(out + d, _mm512_add_ps(vround(_mm512_mul_ps(lo, _mm512_loadu_ps(cos + d))),
                                      vround(_mm512_mul_ps(neg_hi, _mm512_loadu_ps(sin + d)))));
        vstore(out + d + half, _mm512_add_ps(vround(_mm512_mul_ps(hi, _mm512_loadu_ps(cos + d + half))),
                                             vround(_mm512_mul_ps(lo, _mm512_loadu_ps(sin + d + half)))));
      }
    if (d == half) continue;
    d = 0;
#endif
    for (; d < D; ++d) {
      const float x = static_cast<float>(xh[d]);
      const float rotated = d < half ? -static_cast<float>(xh[d + half]) : static_cast<float>(xh[d - half]);
      out[d] = bf16(round_bf16(x * cos[d]) + round_bf16(rotated * sin[d]));
    }
  }
}

// act = silu(gate) * up, each product rounded to bf16 (F.silu's result is a bf16 tensor in the eager model)
void silu_mul(const bf16* gate, const bf16* up, bf16* act, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + VEC <= n; i += VEC) {
    const __m512 g = vload(gate + i);
    const __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = vround(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    vstore(act + i, _mm512_mul_ps(s, vload(up + i)));
  }
#endif
  for (; i < n; ++i) act[i] = bf16(round_bf16(silu(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
}

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  // dims: hidden, heads, kv_heads, head_dim, intermediate, layers. floats: rms eps, attention scale.
  // tensors: embed [V, H] bf16, final norm [H], inv_freq fp32 [D/2], then per layer: input norm, post-attention norm,
  // and its four linears' TENSORS_PER_LINEAR tensors each. linear_meta: META_PER_LINEAR values per linear.
  // caches: per layer k, v. layer_meta: per layer (pool group, sliding window or 0).
  LlamaDecoder(std::vector<int64_t> dims, std::vector<double> floats, std::vector<at::Tensor> tensors,
               std::vector<int64_t> linear_meta, std::vector<at::Tensor> caches, std::vector<int64_t> layer_meta) {
    TORCH_CHECK(dims.size() == 6 && floats.size() == 2, "LlamaDecoder: dims (6) and floats (2)");
    hidden_ = dims[0], heads_ = dims[1], kv_heads_ = dims[2], head_dim_ = dims[3], inter_ = dims[4], layers_ = dims[5];
    TORCH_CHECK(head_dim_ % 2 == 0 && head_dim_ <= 512, "LlamaDecoder: head_dim even and at most 512");
    eps_ = static_cast<float>(floats[0]), scale_ = floats[1];
    const int64_t linears = layers_ * LINEARS_PER_LAYER;
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 3 + layers_ * (2 + LINEARS_PER_LAYER * TENSORS_PER_LINEAR),
                "LlamaDecoder: tensors");
    TORCH_CHECK(static_cast<int64_t>(linear_meta.size()) == META_PER_LINEAR * linears, "LlamaDecoder: linear_meta");
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * layers_ && static_cast<int64_t>(layer_meta.size()) == 2 * layers_,
                "LlamaDecoder: caches and layer_meta per layer");
    embed_ = tensors[0], final_norm_ = tensors[1], inv_freq_ = tensors[2].to(at::kFloat).contiguous();
    TORCH_CHECK(embed_.scalar_type() == at::kBFloat16 && embed_.dim() == 2 && embed_.size(1) == hidden_,
                "LlamaDecoder: bf16 embeddings [V, hidden]");
    TORCH_CHECK(inv_freq_.numel() == head_dim_ / 2, "LlamaDecoder: inv_freq [head_dim / 2]");
    int64_t t = 3;
    for (int64_t l = 0; l < layers_; ++l) {
      norms_.push_back(tensors[t++].contiguous());
      norms_.push_back(tensors[t++].contiguous());
      for (int64_t j = 0; j < LINEARS_PER_LAYER; ++j) {
        NativeLinear lin;
        const int64_t i = l * LINEARS_PER_LAYER + j;
        const int64_t* meta = &linear_meta[META_PER_LINEAR * i];
        lin.kind = meta[0], lin.n = meta[1], lin.group = meta[2], lin.max_rows = meta[3];
        TORCH_CHECK(lin.kind >= 0 && lin.kind < KINDS, "LlamaDecoder: linear kind ", lin.kind);
        lin.a = tensors[t], lin.b = tensors[t + 1], lin.c = tensors[t + 2];
        if (tensors[t + 3].numel()) {
          lin.bias = tensors[t + 3].to(at::kBFloat16).contiguous();
          const bf16* bp = lin.bias.data_ptr<bf16>();
          lin.bias_f.assign(bp, bp + lin.bias.numel());
        }
        if (tensors[t + 4].numel()) lin.perm = tensors[t + 4].to(at::kLong);
        if (tensors[t + 5].numel()) lin.dq_q = tensors[t + 5];
        if (tensors[t + 6].numel()) lin.dq_scale = tensors[t + 6];
        if (tensors[t + 7].numel()) lin.dq_zero = tensors[t + 7];
        const bool dequantizes = lin.kind == INT4_TILED || lin.kind == INT4_ROWS || lin.kind == ATEN_INT4;
        TORCH_CHECK(!dequantizes || (lin.dq_q.defined() && lin.dq_scale.defined() && lin.dq_scale.dim() == 2),
                    "LlamaDecoder: int4 linears need their codes and scales");
        TORCH_CHECK(lin.kind != INT8 || lin.dq_scale.defined(), "LlamaDecoder: int8 linears need bf16 scales");
        t += TENSORS_PER_LINEAR;
        linears_.push_back(lin);
      }
    }
    for (auto& n : norms_) TORCH_CHECK(n.scalar_type() == at::kBFloat16 && n.numel() == hidden_, "LlamaDecoder: norms");
    TORCH_CHECK(final_norm_.scalar_type() == at::kBFloat16 && final_norm_.numel() == hidden_, "LlamaDecoder: norm");
    final_norm_ = final_norm_.contiguous();
    caches_ = std::move(caches);
    layer_meta_ = std::move(layer_meta);
    const int64_t qkv = (heads_ + 2 * kv_heads_) * head_dim_;
    for (int64_t l = 0; l < layers_; ++l) {
      TORCH_CHECK(linears_[l * 4].n == qkv && linears_[l * 4 + 1].n == hidden_ && linears_[l * 4 + 2].n == 2 * inter_ &&
                      linears_[l * 4 + 3].n == hidden_,
                  "LlamaDecoder: layer ", l, "'s projection sizes");
    }
  }

  // One decode token per sequence: ids, positions int64 [M]; per pool group its slot mapping, block tables, sequence
  // lengths and query starts (the runner's metadata). Writes each layer's new K/V into its cache; returns the final
  // normed hidden states [M, hidden] bf16.
  at::Tensor step(const at::Tensor& ids, const at::Tensor& positions, std::vector<at::Tensor> slots,
                  std::vector<at::Tensor> tables, std::vector<at::Tensor> seq_lens, std::vector<at::Tensor> starts) {
    TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes(), "LlamaDecoder.step: ids and positions [M]");
    RECORD_FUNCTION("LlamaDecoder.step", c10::ArrayRef<const c10::IValue>{});
    const int64_t M = ids.size(0), D = head_dim_, H = hidden_;
    const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D;
    at::Tensor h = embed_.index_select(0, ids).contiguous();  // [M, H]: the residual stream
    auto opts = h.options();
    at::Tensor x = at::empty({M, H}, opts);
    // RoPE tables for this step's positions, rounded to bf16 like the model's cos/sin tables
    std::vector<float> cos(M * D), sin(M * D);
    const auto pos = positions.to(at::kLong).contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float* inv = inv_freq_.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t d = 0; d < D; ++d) {
        const float f = static_cast<float>(pp[m]) * inv[d % (D / 2)];
        cos[m * D + d] = round_bf16(std::cos(f));
        sin[m * D + d] = round_bf16(std::sin(f));
      }
    // the step's buffers, reused by every layer
    at::Tensor q = at::empty({M, q_size}, opts), k = at::empty({M, kv_size}, opts), v = at::empty({M, kv_size}, opts);
    at::Tensor act = at::empty({M, inter_}, opts);
    const auto fopts = opts.dtype(at::kFloat);
    at::Tensor xf = at::empty({M, H}, fopts), attn_f = at::empty({M, q_size}, fopts), act_f = at::empty({M, inter_}, fopts);
    for (int64_t l = 0; l < layers_; ++l) {
      const NativeLinear* lin = &linears_[l * LINEARS_PER_LAYER];
      rms_norm(h.data_ptr<bf16>(), norms_[2 * l].data_ptr<bf16>(), x.data_ptr<bf16>(), M, H, eps_);
      widen(x, xf);
      const at::Tensor qkv = lin[0](x, xf);  // [M, q + 2 kv]
      const bf16* qkv_p = qkv.data_ptr<bf16>();
      for (int64_t m = 0; m < M; ++m) {
        const bf16* row = qkv_p + m * (q_size + 2 * kv_size);
        rope(row, q.data_ptr<bf16>() + m * q_size, heads_, D, &cos[m * D], &sin[m * D]);
        rope(row + q_size, k.data_ptr<bf16>() + m * kv_size, kv_heads_, D, &cos[m * D], &sin[m * D]);
        std::memcpy(v.data_ptr<bf16>() + m * kv_size, row + q_size + kv_size, kv_size * sizeof(bf16));
      }
      const int64_t g = layer_meta_[2 * l];
      at::Tensor attn;
      {
        RECORD_FUNCTION("tokq_native::paged_decode_step", c10::ArrayRef<const c10::IValue>{});
        attn = paged_decode_step(q.view({M, heads_, D}), k.view({M, kv_heads_, D}), v.view({M, kv_heads_, D}),
                                 caches_[2 * l], caches_[2 * l + 1], slots[g], tables[g], seq_lens[g], starts[g], scale_,
                                 layer_meta_[2 * l + 1]);
      }
      const at::Tensor attn_rows = attn.reshape({M, q_size});
      widen(attn_rows, attn_f);
      add_into(h, lin[1](attn_rows, attn_f));
      rms_norm(h.data_ptr<bf16>(), norms_[2 * l + 1].data_ptr<bf16>(), x.data_ptr<bf16>(), M, H, eps_);
      widen(x, xf);
      const at::Tensor gu = lin[2](x, xf);  // [M, 2 I]: gate then up
      const bf16* gp = gu.data_ptr<bf16>();
      bf16* ap = act.data_ptr<bf16>();
      for (int64_t m = 0; m < M; ++m) silu_mul(gp + m * 2 * inter_, gp + m * 2 * inter_ + inter_, ap + m * inter_, inter_);
      widen(act, act_f);
      add_into(h, lin[3](act, act_f));
    }
    at::Tensor out = at::empty({M, H}, opts);
    rms_norm(h.data_ptr<bf16>(), final_norm_.data_ptr<bf16>(), out.data_ptr<bf16>(), M, H, eps_);
    return out;
  }

 private:
  static void add_into(at::Tensor& h, const at::Tensor& y) {  // h += y, rounded to bf16 once
    bf16* hp = h.data_ptr<bf16>();
    const bf16* yp = y.data_ptr<bf16>();
    const int64_t n = h.numel();
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + VEC <= n; i += VEC) vstore(hp + i, _mm512_add_ps(vload(hp + i), vload(yp + i)));
#endif
    for (; i < n; ++i) hp[i] = bf16(static_cast<float>(hp[i]) + static_cast<float>(yp[i]));
  }

  int64_t hidden_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0, layers_ = 0;
  float eps_ = 1e-6f;
  double scale_ = 1.0;
  at::Tensor embed_, final_norm_, inv_freq_;
  std::vector<at::Tensor> norms_, caches_;
  std::vector<NativeLinear> linears_;
  std::vector<int64_t> layer_meta_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokq_native, m) {
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<std::vector<int64_t>, std::vector<double>, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("step", &LlamaDecoder::step);
}
