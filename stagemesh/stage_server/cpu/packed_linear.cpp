// A float32 Linear over weights packed in panels of 16 output columns, on the CPU: stagemesh::packed_linear.
//
// y[M, N] = x[M, K] W[N, K]^T + bias, W held as panels [ceil(N / 16), K, 16]: panel p holds output columns
// 16p..16p+15, one row of 16 per input feature, so a panel is read front to back, once per block of rows. Every
// output is one chain of fused multiply-adds over k in order, whatever M and the blocking, so a row's result does
// not depend on the other rows of its pass. The threads split the panels.
//
// int8 panels (--quantize int8-weight-only on a CPU float32 stage) are [ceil(N / 16), K + 4, 16] int8: K rows of 16
// int8 weights, then the panel's 16 float32 scales (one per output column, 64 bytes). Each weight is widened to
// float32 as it is loaded and every output is (x . q) * scale + bias, as Int8WeightLinear computes it: the
// activations stay float32, and a pass reads a quarter of float32's bytes.
//
// With norm_weight, x is first RMS-normalized row by row, as the decoder's norm before this Linear would
// ((x * rsqrt(mean(x^2) + eps)) * weight, torch's order): one call instead of the norm's own half dozen, which cost
// a decode step more than the Linear on small models (README, "The norm inside the Linear").
//
// Why not torch's own matrix product: on this project's CPUs (AMD EPYC) MKL's sgemm reads the weight about
// once per row for small M (a ~270M stage's pass of 4 decode steps costs 3x one), and its GEMV does not scale with
// a second thread; this kernel streams the weight once per pass and splits it across threads, and keeps up with
// oneDNN up to prefill chunks (README, "Packed weights"); on an Intel Xeon it is level with MKL from 256 rows to
// 2048 and about twice as fast from 3 rows to 16 ("Two panels at a time"). Built and loaded by
// stage_server/cpu/cpu_kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the int8 weights' widening loads (weights<L>)
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-float vectors, or one of 16
constexpr int64_t kRowsPerChunk = 64;  // rows of x that each sweep over the panels keeps in cache
constexpr int64_t kPanelsPerTask = 4;  // panels a thread takes at a time (what one row's block reads at once)
// Passes of 3+ rows with AVX-512 (32 vector registers): blocks of up to 14 rows against two panels at once, 28
// accumulators and 2 weight vectors. Each broadcast of an input feeds two multiply-adds (16 loads to 28, the shape
// BLAS kernels take), where a block of 16 rows against one panel (17 loads to 16) waited on the loads; and a block
// reads two panels, two streams, each prefetched into every cache level. ~270M shapes, 4 layers, one thread, on an
// Intel Xeon (AMX, 480 MiB of L3): 3 rows 33 -> 15 ms, 8 rows 31 -> 17, 16 rows 36 -> 21, 32 rows 49 -> 31, 256 rows
// 305 -> 180, 2048 rows 2411 -> ~1400 (MKL: 1287); README, "Two panels at a time".
#if defined(__AVX512F__)
#define KERNEL_WIDE_REGISTERS 1
constexpr int64_t kMaxBlockRows = 14;
constexpr int64_t kBlockRowsFrom = 3;  // passes of 1 or 2 rows read 4 or 2 panels per row, x in place
#else  // 16 registers: blocks of up to 6 rows of two 8-float vectors against one panel
#define KERNEL_WIDE_REGISTERS 0
constexpr int64_t kMaxBlockRows = 6;
constexpr int64_t kBlockRowsFrom = 7;  // passes of 1-6 rows: x in place
#endif
constexpr int64_t kSlice = 256;  // inputs of a panel that the blocks of a pass take at a time: 16 KiB per panel
// How far ahead (in inputs: one 64-byte cache line of a panel each) a block asks for its panels' lines. Without
// AVX-512 a block of 3+ rows reads one panel, one sequential stream, which the hardware's prefetchers alone kept at
// 10-15 GB/s on AMD EPYC, and a non-temporal hint (into L1 only) sped up there (~270M shapes, one thread: 4 rows
// 17.7 -> 10.5 ms; README, "One panel, one stream: prefetched"). On the Intel Xeon that hint halved the AVX-512
// blocks' speed and a hint into every level sped them up (8 rows 20.7 -> 16.5 ms, 256 rows 210 -> 186), so those
// take it. Blocks of 1 or 2 rows read 4 or 2 panels at once and take no hint: with one, they ran slower.
constexpr int64_t kPrefetchAhead = 48;
constexpr int kNoHint = -1, kHintL1 = 0, kHintAll = 3;  // __builtin_prefetch's locality (0: non-temporal)
constexpr int64_t kScaleRows = 4;  // an int8 panel's 16 float32 scales, after its K rows: 4 rows of 16 bytes

// A panel's rows in memory: K rows of weights, then (int8) the scales.
template <typename W>
constexpr int64_t panel_stride(int64_t K) {
  return (K + (std::is_same_v<W, int8_t> ? kScaleRows : 0)) * kPanel;
}

template <int L>  // a vector of L floats, loaded and stored at any float's alignment
struct Lanes {
  typedef float vec __attribute__((vector_size(L * 4)));
  typedef float unaligned __attribute__((vector_size(L * 4), aligned(4)));
  static vec load(const float* p) { return *reinterpret_cast<const unaligned*>(p); }
  static void store(float* p, vec v) { *reinterpret_cast<unaligned*>(p) = v; }
};

// L weights as floats: float32 as they are, int8 widened (exactly: every int8 is a float32). Not members of Lanes:
// there GCC takes the dependent vector type for a plain float.
template <int L>
inline typename Lanes<L>::vec weights(const float* p) {
  return Lanes<L>::load(p);
}
template <int L>
inline typename Lanes<L>::vec weights(const int8_t* p) {
  using vec = typename Lanes<L>::vec;
#if defined(__AVX512F__)
  if constexpr (L == 16)  // a widening load and a convert: GCC compiles the loop below to scalar code (3x slower)
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
#if defined(__AVX2__)
  if constexpr (L == 8)
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  vec out;
  for (int i = 0; i < L; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// MB rows of x (row i's input k at x[i * xi + k * xk]) against NP panels (starting at panel p), over inputs [k0, k1),
// in vectors of L floats: MB x NP x 16 / L accumulators, which start from the bias (k0 == 0) or from the partial
// sums this block stored in y for [0, k0), so that however K is sliced every output is the same chain of
// multiply-adds over k in order (each lane its own chain: the vectors' width changes no output). Hint: how each
// panel's lines are asked for ahead (kPrefetchAhead), or not. int8 panels (W = int8_t): the sums start from 0, and
// the block that ends at K scales them and adds the bias.
template <int MB, int NP, int L = 8, int Hint = kNoHint, typename W = float>
inline void block(const float* x, int64_t xi, int64_t xk, int64_t K, const W* panels, const float* bias, float* y,
                  int64_t N, int64_t p, int64_t k0, int64_t k1) {
  using V = Lanes<L>;
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  constexpr int kVecs = kPanel / L;  // vectors per panel
  constexpr int64_t kAhead = kPrefetchAhead * static_cast<int64_t>(sizeof(float) / sizeof(W));  // the same bytes
  const int64_t stride = panel_stride<W>(K);
  typename V::vec acc[MB][kVecs * NP];
  for (int j = 0; j < kVecs * NP; ++j) {
    const int64_t n = p * kPanel + L * j;  // panel p + j / kVecs
    for (int i = 0; i < MB; ++i) {
      if (k0 == 0) {
        acc[i][j] = bias && !kInt8 ? V::load(bias + n) : typename V::vec{};
      } else if (n + L <= N) {
        acc[i][j] = V::load(y + i * N + n);
      } else {  // the last panel's padding columns were not stored: they start again from 0, and are never read
        acc[i][j] = typename V::vec{};
        for (int64_t c = n; c < N; ++c) acc[i][j][c - n] = y[i * N + c];
      }
    }
  }
  const W* w = panels + p * stride;
  for (int64_t k = k0; k < k1; ++k) {
    if constexpr (Hint != kNoHint)  // never faults
      for (int j = 0; j < NP; ++j) __builtin_prefetch(w + j * stride + (k + kAhead) * kPanel, 0, Hint);
    typename V::vec wk[kVecs * NP];
    for (int j = 0; j < kVecs * NP; ++j) wk[j] = weights<L>(w + (j / kVecs) * stride + k * kPanel + L * (j % kVecs));
    for (int i = 0; i < MB; ++i) {
      const float s = x[i * xi + k * xk];
      for (int j = 0; j < kVecs * NP; ++j) acc[i][j] += s * wk[j];
    }
  }
  if constexpr (kInt8) {
    if (k1 == K) {
      for (int j = 0; j < kVecs * NP; ++j) {
        const auto* scales = reinterpret_cast<const float*>(w + (j / kVecs) * stride + K * kPanel);
        const typename V::vec scale = V::load(scales + L * (j % kVecs));
        const typename V::vec b = bias ? V::load(bias + p * kPanel + L * j) : typename V::vec{};
        for (int i = 0; i < MB; ++i) acc[i][j] = bias ? acc[i][j] * scale + b : acc[i][j] * scale;
      }
    }
  }
  for (int j = 0; j < kVecs * NP; ++j) {
    const int64_t n = p * kPanel + L * j;
    if (n + L <= N) {
      for (int i = 0; i < MB; ++i) V::store(y + i * N + n, acc[i][j]);
    } else {  // the last panel's padding columns are not written
      for (int i = 0; i < MB; ++i)
        for (int64_t c = n; c < N; ++c) y[i * N + c] = acc[i][j][c - n];
    }
  }
}

// x [M, K] (M >= kBlockRowsFrom) copied block by block as rows_against_panels splits it, each block's rows
// interleaved input by input (block b, rows [r, r + n), at offset r * K, its row i's input k at k * n + i), so that a
// block reads x front to back. Read in place, a block's rows lie K floats apart: for K = 1024 every one of them
// falls in the same L1 set (8 ways), and blocks of 16 rows ran at half speed (~270M shapes, 4 layers, one thread:
// 16 rows 31.7 ms in place against 18.1 interleaved, 256 rows 497 against 265; README, "Passes of 7-16 rows: one
// block").
void interleave_blocks(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t blocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r = b * M / blocks, n = (b + 1) * M / blocks - r;
    float* o = out + r * K;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < K; ++k) o[k * n + i] = x[(r + i) * K + k];
  }
}

// One block of n rows (interleaved) against NP panels from p, over inputs [k0, k1): with AVX-512 n is 3-14 rows
// of 16-float vectors; without it 3-6 rows (blocks split as evenly as they can: 8 rows are 4 + 4, not 6 + 2, whose
// second block would wait on its chains) of two 8-float vectors.
template <int NP, typename W>
void block_of(int64_t n, const float* x, int64_t K, const W* panels, const float* bias, float* y, int64_t N,
              int64_t p, int64_t k0, int64_t k1) {
#if KERNEL_WIDE_REGISTERS
  constexpr int L = 16, H = kHintAll;
  switch (n) {
    case 3: block<3, NP, L, H, W>(x, 1, 3, K, panels, bias, y, N, p, k0, k1); break;
    case 4: block<4, NP, L, H, W>(x, 1, 4, K, panels, bias, y, N, p, k0, k1); break;
    case 5: block<5, NP, L, H, W>(x, 1, 5, K, panels, bias, y, N, p, k0, k1); break;
    case 6: block<6, NP, L, H, W>(x, 1, 6, K, panels, bias, y, N, p, k0, k1); break;
    case 7: block<7, NP, L, H, W>(x, 1, 7, K, panels, bias, y, N, p, k0, k1); break;
    case 8: block<8, NP, L, H, W>(x, 1, 8, K, panels, bias, y, N, p, k0, k1); break;
    case 9: block<9, NP, L, H, W>(x, 1, 9, K, panels, bias, y, N, p, k0, k1); break;
    case 10: block<10, NP, L, H, W>(x, 1, 10, K, panels, bias, y, N, p, k0, k1); break;
    case 11: block<11, NP, L, H, W>(x, 1, 11, K, panels, bias, y, N, p, k0, k1); break;
    case 12: block<12, NP, L, H, W>(x, 1, 12, K, panels, bias, y, N, p, k0, k1); break;
    case 13: block<13, NP, L, H, W>(x, 1, 13, K, panels, bias, y, N, p, k0, k1); break;
    default: block<14, NP, L, H, W>(x, 1, 14, K, panels, bias, y, N, p, k0, k1); break;
  }
#else
  constexpr int L = 8, H = kHintL1;
  switch (n) {
    case 3: block<3, NP, L, H, W>(x, 1, 3, K, panels, bias, y, N, p, k0, k1); break;
    case 4: block<4, NP, L, H, W>(x, 1, 4, K, panels, bias, y, N, p, k0, k1); break;
    case 5: block<5, NP, L, H, W>(x, 1, 5, K, panels, bias, y, N, p, k0, k1); break;
    default: block<6, NP, L, H, W>(x, 1, 6, K, panels, bias, y, N, p, k0, k1); break;
  }
#endif
}

// Rows [0, M) of x against panels [p0, p1). From kBlockRowsFrom rows: x as interleave_blocks lays it out, in
// blocks of up to kMaxBlockRows as even as they split, each panel (with AVX-512 each pair of panels) a slice of
// kSlice inputs at a time, so that the slice, read from memory by the first block, stays in L1 for the others (a
// whole panel does not: before, a pass of 7-16 rows ran at half the arithmetic rate of a prefill chunk; README,
// "Passes of a few rows"). Fewer rows: x as it is, one sweep over each panel, one or two rows taking several panels
// at once (a single chain per vector would wait on the multiply-add's latency).
template <typename W>
void rows_against_panels(const float* x, int64_t M, int64_t K, const W* panels, const float* bias, float* y,
                         int64_t N, int64_t p0, int64_t p1) {
  if (M >= kBlockRowsFrom) {
    constexpr int64_t kStep = KERNEL_WIDE_REGISTERS ? 2 : 1;  // panels a block reads at once
    const int64_t blocks = (M + kMaxBlockRows - 1) / kMaxBlockRows;
    for (int64_t p = p0; p < p1; p += kStep)
      for (int64_t k0 = 0; k0 < K; k0 += kSlice) {
        const int64_t k1 = std::min(K, k0 + kSlice);
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r = b * M / blocks, n = (b + 1) * M / blocks - r;
          if (kStep == 2 && p + 1 < p1) block_of<2, W>(n, x + r * K, K, panels, bias, y + r * N, N, p, k0, k1);
          else block_of<1, W>(n, x + r * K, K, panels, bias, y + r * N, N, p, k0, k1);
        }
      }
    return;
  }
  int64_t p = p0;
  switch (M) {
    case 1:
      for (; p + 4 <= p1; p += 4) block<1, 4, 8, kNoHint, W>(x, K, 1, K, panels, bias, y, N, p, 0, K);
      for (; p < p1; ++p) block<1, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K);
      break;
    case 2:
      for (; p + 2 <= p1; p += 2) block<2, 2, 8, kNoHint, W>(x, K, 1, K, panels, bias, y, N, p, 0, K);
      for (; p < p1; ++p) block<2, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K);
      break;
    case 3: for (; p < p1; ++p) block<3, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K); break;
    case 4: for (; p < p1; ++p) block<4, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K); break;
    case 5: for (; p < p1; ++p) block<5, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K); break;
    default: for (; p < p1; ++p) block<6, 1, 8, kHintL1, W>(x, K, 1, K, panels, bias, y, N, p, 0, K); break;
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

int64_t packed_inputs(const at::Tensor& panels) {
  return panels.size(1) - (panels.scalar_type() == at::kChar ? kScaleRows : 0);
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::optional<at::Tensor>& norm_weight, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "x must be contiguous [M, K] float32");
  const at::Tensor x = norm_weight.has_value() && norm_weight->defined() ? rms_normalized(x_in, *norm_weight, eps)
                                                                         : x_in;
  const bool int8 = panels.scalar_type() == at::kChar;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && (int8 || panels.scalar_type() == at::kFloat) &&
              panels.is_contiguous(), "panels must be contiguous [P, K, 16] float32 or [P, K + 4, 16] int8");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = panels.size(0);
  TORCH_CHECK(packed_inputs(panels) == K, "x has ", K, " features; the panels ", packed_inputs(panels));
  TORCH_CHECK(N >= 1 && (N + kPanel - 1) / kPanel == P, "out_features ", N, " does not fill ", P, " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == P * kPanel && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bias must be contiguous float32, padded to the panels' ", P * kPanel);
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> interleaved(M >= kBlockRowsFrom ? std::min(M, kRowsPerChunk) * K : 0);
  for (int64_t m = 0; m < M; m += kRowsPerChunk) {  // big M (prefill): x's chunk stays in cache across panels
    const int64_t rows = std::min(kRowsPerChunk, M - m);
    const float* xm = xp + m * K;
    if (rows >= kBlockRowsFrom) {
      interleave_blocks(xm, rows, K, interleaved.data());
      xm = interleaved.data();
    }
    const int64_t tasks = (P + kPanelsPerTask - 1) / kPanelsPerTask;
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      const int64_t p0 = t0 * kPanelsPerTask, p1 = std::min(P, t1 * kPanelsPerTask);
      if (int8) rows_against_panels(xm, rows, K, panels.data_ptr<int8_t>(), b, yp + m * N, N, p0, p1);
      else rows_against_panels(xm, rows, K, panels.data_ptr<float>(), b, yp + m * N, N, p0, p1);
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
