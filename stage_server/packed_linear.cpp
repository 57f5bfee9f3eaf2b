// A float32 Linear over weights packed in panels of 16 output columns, on the CPU: stagemesh::packed_linear.
//
// y[M, N] = x[M, K] W[N, K]^T + bias, W held as panels [ceil(N / 16), K, 16]: panel p holds output columns
// 16p..16p+15, one row of 16 per input feature, so a panel is read front to back, once per block of rows. Every
// output is one chain of fused multiply-adds over k in order, whatever M and the blocking, so a row's result does
// not depend on the other rows of its pass. The threads split the panels.
//
// With norm_weight, x is first RMS-normalized row by row, as the decoder's norm before this Linear would
// ((x * rsqrt(mean(x^2) + eps)) * weight, torch's order): one call instead of the norm's own half dozen, which cost
// a decode step more than the Linear on small models (README, "The norm inside the Linear").
//
// Why not torch's own matrix product: on this project's CPUs (AMD EPYC, AVX2) MKL's sgemm reads the weight about
// once per row for small M (a ~270M stage's pass of 4 decode steps costs 3x one), and its GEMV does not scale with
// a second thread; this kernel streams the weight once per pass and splits it across threads, and keeps up with
// oneDNN up to prefill chunks (README, "Packed weights"). Built and loaded by stage_server/cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-float vectors
constexpr int64_t kRowsPerChunk = 64;  // rows of x that each sweep over the panels keeps in cache
constexpr int64_t kPanelsPerTask = 4;  // panels a thread takes at a time (what one row's block reads at once)
constexpr int64_t kSlice = 256;  // inputs of a panel that the blocks of a pass of 7+ rows take at a time: 16 KiB
// How far ahead (in inputs: one 64-byte cache line of a panel each) a block that reads a single panel asks for
// the panel's lines. A block of 3+ rows reads one panel, one sequential stream, and the hardware's prefetchers
// alone kept it at 10-15 GB/s where the 4 streams of a lone row's blocks reach ~25 (~270M shapes, one thread:
// 4 rows 17.7 -> 10.5 ms, 8 rows 24.4 -> 16.1, 16 rows 35.3 -> 24.5 over 4 layers; README, "One panel, one stream:
// prefetched"). A block of 1 or 2 rows reads 4 or 2 panels at once and takes no hint: with it, it ran slower.
constexpr int64_t kPrefetchAhead = 48;

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }

// MB rows of x against NP panels (starting at panel p), over inputs [k0, k1): MB x 2NP accumulators, which start
// from the bias (k0 == 0) or from the partial sums this block stored in y for [0, k0), so that however K is
// sliced every output is the same chain of multiply-adds over k in order.
template <int MB, int NP>
inline void block(const float* x, int64_t K, const float* panels, const float* bias, float* y, int64_t N,
                  int64_t p, int64_t k0, int64_t k1) {
  v8 acc[MB][2 * NP];
  for (int j = 0; j < 2 * NP; ++j) {
    const int64_t n = p * kPanel + 8 * j;  // panel p + j / 2, half j % 2
    for (int i = 0; i < MB; ++i) {
      if (k0 == 0) {
        acc[i][j] = bias ? load(bias + n) : v8{};
      } else if (n + 8 <= N) {
        acc[i][j] = load(y + i * N + n);
      } else {  // the last panel's padding columns were not stored: they start again from 0, and are never read
        acc[i][j] = v8{};
        for (int64_t c = n; c < N; ++c) acc[i][j][c - n] = y[i * N + c];
      }
    }
  }
  const float* w = panels + p * K * kPanel;
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (NP == 1) __builtin_prefetch(w + (k + kPrefetchAhead) * kPanel, 0, 0);  // never faults
    v8 wk[2 * NP];
    for (int j = 0; j < 2 * NP; ++j) wk[j] = load(w + (j / 2) * K * kPanel + k * kPanel + 8 * (j % 2));
    for (int i = 0; i < MB; ++i) {
      const float s = x[i * K + k];
      const v8 xb = {s, s, s, s, s, s, s, s};
      for (int j = 0; j < 2 * NP; ++j) acc[i][j] += xb * wk[j];
    }
  }
  for (int j = 0; j < 2 * NP; ++j) {
    const int64_t n = p * kPanel + 8 * j;
    if (n + 8 <= N) {
      for (int i = 0; i < MB; ++i) store(y + i * N + n, acc[i][j]);
    } else {  // the last panel's padding columns are not written
      for (int i = 0; i < MB; ++i)
        for (int64_t c = n; c < N; ++c) y[i * N + c] = acc[i][j][c - n];
    }
  }
}

// Rows [0, M) of x against panels [p0, p1). Up to 6 rows: one sweep over each panel, one or two rows taking
// several panels at once (a single chain per vector would wait on the multiply-add's latency). More rows: in
// blocks of 3 to 6 (as even as they split: 8 rows are 4 + 4, not 6 + 2, whose second block would wait on its
// chains), each panel a slice of kSlice inputs at a time, so that the slice, read from memory by the first block,
// stays in L1 for the others (a whole panel does not: before, a pass of 7-16 rows ran at half the arithmetic rate
// of a prefill chunk; README, "Passes of a few rows").
void rows_against_panels(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, float* y,
                         int64_t N, int64_t p0, int64_t p1) {
  if (M > 6) {
    const int64_t blocks = (M + 5) / 6;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
        const int64_t k1 = std::min(K, k0 + kSlice);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r = b * M / blocks;
          const float* xb = x + r * K;
          float* yb = y + r * N;
          switch ((b + 1) * M / blocks - r) {
            case 3: block<3, 1>(xb, K, panels, bias, yb, N, p, k0, k1); break;
            case 4: block<4, 1>(xb, K, panels, bias, yb, N, p, k0, k1); break;
            case 5: block<5, 1>(xb, K, panels, bias, yb, N, p, k0, k1); break;
            default: block<6, 1>(xb, K, panels, bias, yb, N, p, k0, k1); break;
          }
        }
      }
    return;
  }
  int64_t p = p0;
  switch (M) {
    case 1:
      for (; p + 4 <= p1; p += 4) block<1, 4>(x, K, panels, bias, y, N, p, 0, K);
      for (; p < p1; ++p) block<1, 1>(x, K, panels, bias, y, N, p, 0, K);
      break;
    case 2:
      for (; p + 2 <= p1; p += 2) block<2, 2>(x, K, panels, bias, y, N, p, 0, K);
      for (; p < p1; ++p) block<2, 1>(x, K, panels, bias, y, N, p, 0, K);
      break;
    case 3: for (; p < p1; ++p) block<3, 1>(x, K, panels, bias, y, N, p, 0, K); break;
    case 4: for (; p < p1; ++p) block<4, 1>(x, K, panels, bias, y, N, p, 0, K); break;
    case 5: for (; p < p1; ++p) block<5, 1>(x, K, panels, bias, y, N, p, 0, K); break;
    default: for (; p < p1; ++p) block<6, 1>(x, K, panels, bias, y, N, p, 0, K); break;
  }
}

// x's rows RMS-normalized into a new [M, K]: the sum of squares in double (so the mean is float32's nearest),
// then (x * r) * weight in float32, as torch's rms_norm multiplies.
at::Tensor rms_normalized(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == K && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "norm_weight must be contiguous float32 [", K, "]");
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * K;
    double squares = 0.0;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < K; ++k) squares += static_cast<double>(r[k]) * r[k];
    const float mean = static_cast<float>(squares / static_cast<double>(K));
    const float scale = 1.f / std::sqrt(mean + static_cast<float>(eps));
    float* y = o + m * K;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) y[k] = (r[k] * scale) * w[k];
  }
  return out;
}

}  // namespace

namespace stagemesh {

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "x must be contiguous [M, K] float32");
  const at::Tensor x = norm_weight.has_value() && norm_weight->defined() ? rms_normalized(x_in, *norm_weight, eps)
                                                                         : x_in;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.scalar_type() == at::kFloat &&
              panels.is_contiguous(), "panels must be contiguous [P, K, 16] float32");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features; the panels ", panels.size(1));
  TORCH_CHECK(N >= 1 && (N + kPanel - 1) / kPanel == P, "out_features ", N, " does not fill ", P, " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == P * kPanel && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bias must be contiguous float32, padded to the panels' ", P * kPanel);
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; m += kRowsPerChunk) {  // big M (prefill): x's chunk stays in cache across panels
    const int64_t rows = std::min(kRowsPerChunk, M - m);
    const int64_t tasks = (P + kPanelsPerTask - 1) / kPanelsPerTask;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      rows_against_panels(xp + m * K, rows, K, w, b, yp + m * N, N, t0 * kPanelsPerTask,
                          std::min(P, t1 * kPanelsPerTask));
    });
  }
  return y;
}

}  // namespace stagemesh

TORCH_LIBRARY_FRAGMENT(stagemesh, m) {
  m.def("packed_linear(Tensor x, Tensor panels, Tensor? bias, int out_features, Tensor? norm_weight=None, "
        "float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagemesh, CPU, m) { m.impl("packed_linear", &stagemesh::packed_linear); }
