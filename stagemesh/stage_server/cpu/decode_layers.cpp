// A decode pass's decoder layers in one call, on the CPU in float32: stagemesh::decode_layers.
//
// Eager PyTorch runs a Llama-family layer's decode pass as ~25 calls through Python and the dispatcher (the packed
// Linears, rotary embedding, the K/V writes, attention, the residual adds, silu(gate) * up, and the views between
// them). On a small model that overhead is most of a step, and it grows when a stage's caches are cold, as they are
// in a mesh, where the event loop, gRPC and the other processes run between two steps (README, "One call per
// layer"). This op does the same math in one call, with the same kernels: the norm inside each packed Linear
// (packed_linear.cpp), rotary embedding as model.apply_rope writes it, each step's K/V written at its slot in the
// pool, attention over the pool (paged_attention.cpp), the residual adds and silu(gate) * up. All of a stage's
// layers go in the one call: between two layers' calls Python and the dispatcher ran ~80 µs on a ~270M stage,
// whose layers' weights had just pushed their code and data out of every cache (README, "All layers in one call").
// Built and loaded by stage_server/cpu/cpu_kernels.py, used by stage_server/cpu/decode_layers.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_kernels.h"

namespace {

// x * cos + roll(x, D / 2) * signed_sin over one head's row (model.apply_rope): two products and a sum, each
// rounded on its own as torch's three ops round them (no fused multiply-add), so the result is torch's bit for bit.
__attribute__((optimize("fp-contract=off"))) void rope_row(const float* x, const float* cos, const float* sin,
                                                           float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float a = x[d] * cos[d];
    const float b = x[d < half ? d + half : d - half] * sin[d];
    out[d] = a + b;
  }
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be contiguous float32");
}

}  // namespace

namespace stagemesh {
namespace {

constexpr int64_t kWeightsPerLayer = 10;  // qkv, its bias, the input norm, o, its bias, gate_up, its bias, the
                                          // post-attention norm, down, its bias

// Layer i's weights from the flat list decode_layers takes: its j-th of kWeightsPerLayer.
at::Tensor required(const c10::List<std::optional<at::Tensor>>& weights, int64_t i, int64_t j, const char* name) {
  const std::optional<at::Tensor> w = weights.get(i * kWeightsPerLayer + j);  // a copy: the list holds IValues
  TORCH_CHECK(w.has_value() && w->defined(), "layer ", i, "'s ", name, " is missing");
  return *w;
}

std::optional<at::Tensor> optional(const c10::List<std::optional<at::Tensor>>& weights, int64_t i, int64_t j) {
  return weights.get(i * kWeightsPerLayer + j);
}

// One layer over the pass: x [B, hidden] in, the layer's output out (see decode_layers for the rest).
at::Tensor layer_pass(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weights, int64_t i,
                      double input_eps, double post_eps, const at::Tensor& cos, const at::Tensor& sin,
                      const int64_t* sl, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                      const at::Tensor& ends, int64_t block_size, int64_t window, int64_t H, double scale) {
  const int64_t B = x.size(0), hidden = x.size(1), kvH = k_pool.size(1), D = k_pool.size(2);
  const at::Tensor down = required(weights, i, 8, "down");
  const int64_t I = packed_inputs(down);  // the MLP's intermediate size: the down projection's inputs
  const int64_t width = (H + 2 * kvH) * D;
  const at::Tensor qkv_out = packed_linear(x, required(weights, i, 0, "qkv"), optional(weights, i, 1), width,
                                           required(weights, i, 2, "input norm"), input_eps);  // [B, width]
  at::Tensor q = at::empty({B, H, D}, x.options());
  const float* r = qkv_out.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = r + b * width;
    const float* c = cp + b * D;
    const float* s = sp + b * D;
    for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, s, qp + (b * H + h) * D, D);
    for (int64_t h = 0; h < kvH; ++h) rope_row(row + (H + h) * D, c, s, kp + (sl[b] * kvH + h) * D, D);
    std::memcpy(vp + sl[b] * kvH * D, row + (H + kvH) * D, kvH * D * sizeof(float));
  }
  const at::Tensor attended = decode_attention(q, k_pool, v_pool, table, ends, block_size, window, scale);

  at::Tensor h = packed_linear(attended.view({B, H * D}), required(weights, i, 3, "o"), optional(weights, i, 4),
                               hidden, std::nullopt, 0.0);
  float* hp = h.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t j = 0; j < B * hidden; ++j) hp[j] = xp[j] + hp[j];  // x + attention's output

  const at::Tensor gu = packed_linear(h, required(weights, i, 5, "gate_up"), optional(weights, i, 6), 2 * I,
                                      required(weights, i, 7, "post-attention norm"), post_eps);  // [B, 2I]
  at::Tensor act = at::empty({B, I}, x.options());
  const float* g = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < I; ++j) {
      const float gate = g[b * 2 * I + j];
      const float silu = gate / (1.f + std::exp(-gate));  // torch's silu: x / (1 + e^-x)
      ap[b * I + j] = silu * g[b * 2 * I + I + j];
    }
  at::Tensor out = packed_linear(act, down, optional(weights, i, 9), hidden, std::nullopt, 0.0);
  float* op = out.data_ptr<float>();
  for (int64_t j = 0; j < B * hidden; ++j) op[j] = hp[j] + op[j];  // h + the MLP's output
  return out;
}

}  // namespace

// x: the decode steps' hidden states [B, hidden], one row per session, or with embed [vocab, hidden] (the first
// stage) their token ids [B]; weights: each layer's kWeightsPerLayer
// (qkv, qkv_bias, input_norm, o, o_bias, gate_up, gate_up_bias, post_norm, down, down_bias; the biases may be
// None), eps: each layer's two norms' (input, post); cos, sin [B, ..., D]: each row's rotary table (sin signed,
// model.rope_tables); slots [B]: where each step's K/V go in the pool; k_pools, v_pools: each layer's
// [slots, kvH, D]; windows: each layer's sliding window (0: none); table, ends, block_size, scale: as
// decode_attention takes them; head (the last stage's LM head as packed panels, with head_bias, head_norm: the final
// norm, head_eps, head_out: the vocabulary), or None. Returns the last layer's output [B, hidden], or with head its
// logits [B, head_out]: embedding and head inside the call spare two more trips through Python and the dispatcher,
// made with the caches just emptied by the layers' weights (~280 µs before a ~270M head; README, "All layers in one
// call").
at::Tensor decode_layers(const at::Tensor& x_in, const c10::List<std::optional<at::Tensor>>& weights,
                         at::ArrayRef<double> eps, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, at::TensorList k_pools, at::TensorList v_pools,
                         const at::Tensor& table, const at::Tensor& ends, int64_t block_size, at::IntArrayRef windows,
                         int64_t heads, double scale, const std::optional<at::Tensor>& embed,
                         const std::optional<at::Tensor>& head, const std::optional<at::Tensor>& head_bias,
                         const std::optional<at::Tensor>& head_norm, double head_eps, int64_t head_out) {
  const bool embeds = embed.has_value() && embed->defined(), with_head = head.has_value() && head->defined();
  const int64_t L = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_pools.size()) == L && static_cast<int64_t>(windows.size()) == L &&
              static_cast<int64_t>(eps.size()) == 2 * L &&
              static_cast<int64_t>(weights.size()) == kWeightsPerLayer * L,
              "every layer needs its K and V pools, its window, its 2 norms' eps and its ", kWeightsPerLayer,
              " weights");
  if (embeds) {
    TORCH_CHECK(x_in.dim() == 1 && x_in.scalar_type() == at::kLong, "with embed, x must be token ids [B] int64");
    check_float(*embed, "embed");
  } else {
    TORCH_CHECK(x_in.dim() == 2, "x must be [B, hidden]");
    check_float(x_in, "x");
  }
  check_float(cos, "cos");
  check_float(sin, "sin");
  const int64_t B = x_in.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "slots must be [B] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; ++i) {  // every check before the first write
    const at::Tensor &k = k_pools[i], &v = v_pools[i];
    check_float(k, "k_pool");
    check_float(v, "v_pool");
    TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k_pool and v_pool must be [slots, kvH, D]");
    const int64_t kvH = k.size(1), D = k.size(2);
    TORCH_CHECK(heads >= 1 && kvH >= 1 && heads % kvH == 0 && D % 2 == 0,
                "heads must be a multiple of the pool's kv heads, D even");
    TORCH_CHECK(cos.numel() == B * D && sin.numel() == B * D, "cos and sin must hold a row of ", D, " per step");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(sl[b] >= 0 && sl[b] < k.size(0), "slot ", sl[b], " is not in the pool");
  }
  at::Tensor x = embeds ? embed->index_select(0, x_in) : x_in;  // index_select refuses an id outside the table
  for (int64_t i = 0; i < L; ++i)
    x = layer_pass(x, weights, i, eps[2 * i], eps[2 * i + 1], cos, sin, sl, k_pools[i], v_pools[i], table, ends,
                   block_size, windows[i], heads, scale);
  return with_head ? packed_linear(x, *head, head_bias, head_out, head_norm, head_eps) : x;
}

}  // namespace stagemesh

TORCH_LIBRARY_FRAGMENT(stagemesh, m) {
  m.def("decode_layers(Tensor x, Tensor?[] weights, float[] eps, Tensor cos, Tensor sin, Tensor slots, "
        "Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor table, Tensor ends, int block_size, int[] windows, "
        "int heads, float scale, Tensor? embed=None, Tensor? head=None, Tensor? head_bias=None, "
        "Tensor? head_norm=None, float head_eps=0.0, int head_out=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagemesh, CPU, m) { m.impl("decode_layers", &stagemesh::decode_layers); }
