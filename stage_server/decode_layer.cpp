// One decoder layer's decode steps in one call, on the CPU in float32: stagemesh::decode_layer.
//
// Eager PyTorch runs a Llama-family layer's decode pass as ~25 calls through Python and the dispatcher (the packed
// Linears, rotary embedding, the K/V writes, attention, the residual adds, silu(gate) * up, and the views between
// them). On a small model that overhead is most of a step, and it grows when a stage's caches are cold, as they are
// in a mesh, where the event loop, gRPC and the other processes run between two steps (README, "One call per
// layer"). This op does the same math in one call, with the same kernels: the norm inside each packed Linear
// (packed_linear.cpp), rotary embedding as model.apply_rope writes it, each step's K/V written at its slot in the
// pool, attention over the pool (paged_attention.cpp), the residual adds and silu(gate) * up.
// Built and loaded by stage_server/cpu_kernels.py, used by stage_server/decode_layer.py.

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

// x [B, hidden]: the decode steps' hidden states, one row per session; cos, sin [B, ..., D]: each row's rotary
// table (sin signed, model.rope_tables); slots [B]: where each step's K/V go in the pool; k_pool, v_pool
// [slots, kvH, D]: this layer's; table, ends, block_size, window, scale: as decode_attention takes them.
// Returns the layer's output [B, hidden].
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& qkv, const std::optional<at::Tensor>& qkv_bias,
                        const at::Tensor& input_norm, double input_eps, const at::Tensor& o,
                        const std::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
                        const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& post_norm, double post_eps,
                        const at::Tensor& down, const std::optional<at::Tensor>& down_bias, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& table, const at::Tensor& ends, int64_t block_size,
                        int64_t window, int64_t heads, double scale) {
  TORCH_CHECK(x.dim() == 2, "x must be [B, hidden]");
  check_float(x, "x");
  check_float(k_pool, "k_pool");
  check_float(v_pool, "v_pool");
  check_float(cos, "cos");
  check_float(sin, "sin");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "k_pool and v_pool must be [slots, kvH, D]");
  const int64_t B = x.size(0), hidden = x.size(1), H = heads, kvH = k_pool.size(1), D = k_pool.size(2);
  const int64_t I = down.size(1);  // the MLP's intermediate size: the down projection's inputs
  TORCH_CHECK(H >= 1 && kvH >= 1 && H % kvH == 0 && D % 2 == 0,
              "heads must be a multiple of the pool's kv heads, D even");
  TORCH_CHECK(cos.numel() == B * D && sin.numel() == B * D, "cos and sin must hold a row of ", D, " per step");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
              "slots must be [B] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < k_pool.size(0), "slot ", sl[b], " is not in the pool");

  const int64_t width = (H + 2 * kvH) * D;
  const at::Tensor qkv_out = packed_linear(x, qkv, qkv_bias, width, input_norm, input_eps);  // [B, width]
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

  at::Tensor h = packed_linear(attended.view({B, H * D}), o, o_bias, hidden, std::nullopt, 0.0);
  float* hp = h.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < B * hidden; ++i) hp[i] = xp[i] + hp[i];  // x + attention's output

  const at::Tensor gu = packed_linear(h, gate_up, gate_up_bias, 2 * I, post_norm, post_eps);  // [B, 2I]: gate, up
  at::Tensor act = at::empty({B, I}, x.options());
  const float* g = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i) {
      const float gate = g[b * 2 * I + i];
      const float silu = gate / (1.f + std::exp(-gate));  // torch's silu: x / (1 + e^-x)
      ap[b * I + i] = silu * g[b * 2 * I + I + i];
    }
  at::Tensor out = packed_linear(act, down, down_bias, hidden, std::nullopt, 0.0);
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < B * hidden; ++i) op[i] = hp[i] + op[i];  // h + the MLP's output
  return out;
}

}  // namespace stagemesh

TORCH_LIBRARY_FRAGMENT(stagemesh, m) {
  m.def("decode_layer(Tensor x, Tensor qkv, Tensor? qkv_bias, Tensor input_norm, float input_eps, Tensor o, "
        "Tensor? o_bias, Tensor gate_up, Tensor? gate_up_bias, Tensor post_norm, float post_eps, Tensor down, "
        "Tensor? down_bias, Tensor cos, Tensor sin, Tensor slots, Tensor(a!) k_pool, Tensor(b!) v_pool, "
        "Tensor table, Tensor ends, int block_size, int window, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagemesh, CPU, m) { m.impl("decode_layer", &stagemesh::decode_layer); }
