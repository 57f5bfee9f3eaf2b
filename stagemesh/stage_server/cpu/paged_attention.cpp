// Decode attention read straight from the paged KV pool, on the CPU: stagemesh::decode_attention.
//
// One query position per session (a decode step), every session of the pass in one call: each session's keys
// and values are read where they lie, block by block through its block table, once for K and once for V.
// The gather + SDPA path (stage_server/engine/model.py) copies them into a padded contiguous buffer first and reads
// them again, three passes over the pass's whole KV instead of one; on a busy stage the KV outweighs the
// weights. Softmax in float32, exactly (two passes: scores, then weights), whatever the pool's dtype.
// Built and loaded by stage_server/cpu/cpu_kernels.py, used by stage_server/engine/paged_attention.py.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

namespace {

// Sixteen float lanes (GCC's and clang's vector extensions, whatever the target: one AVX-512 register, two AVX2).
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

// e^x for x <= 0 (a score less its row's largest), lane by lane: 2^(x log2 e) = 2^n 2^f, f in [-0.5, 0.5], 2^f
// by its Taylor series to degree 7 (relative error under 2e-8).
inline v16 exp_nonpositive(v16 x) {
  const v16 lowest = v16{} - 87.f;  // e^-87: about float32's smallest normal
  const v16 t = (x > lowest ? x : lowest) * 1.44269504088896341f;
  const i16 n = __builtin_convertvector(t - 0.5f, i16);  // t <= 0: truncation of t - 0.5 rounds t to nearest
  const v16 f = t - __builtin_convertvector(n, v16);
  v16 p = v16{} + 1.525273380405984e-5f;
  p = p * f + 1.540353039338161e-4f;
  p = p * f + 1.333355814642844e-3f;
  p = p * f + 9.618129107628477e-3f;
  p = p * f + 5.550410866482158e-2f;
  p = p * f + 2.402265069591007e-1f;
  p = p * f + 6.931471805599453e-1f;
  p = p * f + 1.f;
  return p * reinterpret_cast<v16>((n + 127) << 23);  // 2^n: n + 127 in the exponent's bits
}

// A row of n scores (n >= 1) becomes its softmax, in place, 16 at a time (the last 16 through a padded copy):
// its largest score, e^(score - largest) and their sum (lane by lane, then across the lanes), then the
// scaling. Written with vectors because GCC left the plain loops scalar (a max reduction's NaN rules, a bit
// cast in e^x): a third of the kernel's time on cache-resident K/V. Each score's e^x is the same arithmetic
// wherever it lies in the row.
inline void softmax_row(float* s, int64_t n) {
  float pad[16];
  auto load = [&](int64_t i, float fill) {
    if (i + 16 <= n) return *reinterpret_cast<const v16u*>(s + i);
    std::fill(pad, pad + 16, fill);
    std::memcpy(pad, s + i, (n - i) * sizeof(float));
    return *reinterpret_cast<const v16u*>(pad);
  };
  v16 top = load(0, s[0]);
  for (int64_t i = 16; i < n; i += 16) {
    const v16 x = load(i, s[0]);
    top = x > top ? x : top;
  }
  float m = top[0];
  for (int l = 1; l < 16; ++l) m = std::max(m, top[l]);
  v16 sums = {};
  for (int64_t i = 0; i < n; i += 16) {
    const v16 e = exp_nonpositive(load(i, m) - m);
    if (i + 16 <= n) {
      *reinterpret_cast<v16u*>(s + i) = e;
      sums += e;
    } else {
      float lanes[16];
      *reinterpret_cast<v16u*>(lanes) = e;
      std::memcpy(s + i, lanes, (n - i) * sizeof(float));
      for (int64_t l = 0; l < n - i; ++l) sums[l] += lanes[l];
    }
  }
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += sums[l];
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

#if defined(__AVX512F__) && !defined(__clang__)  // GCC's __builtin_shuffle
// One level of the transpose-reduce below: with h the level's half width, lane i of the result is x[i] + x[i + h]
// where i % 2h < h, else y[i - h] + y[i].
template <int h>
inline v16 fold(v16 x, v16 y) {
  constexpr i16 a = {0 % (2 * h) < h ? 0 : 16 + 0 - h, 1 % (2 * h) < h ? 1 : 16 + 1 - h,
                     2 % (2 * h) < h ? 2 : 16 + 2 - h, 3 % (2 * h) < h ? 3 : 16 + 3 - h,
                     4 % (2 * h) < h ? 4 : 16 + 4 - h, 5 % (2 * h) < h ? 5 : 16 + 5 - h,
                     6 % (2 * h) < h ? 6 : 16 + 6 - h, 7 % (2 * h) < h ? 7 : 16 + 7 - h,
                     8 % (2 * h) < h ? 8 : 16 + 8 - h, 9 % (2 * h) < h ? 9 : 16 + 9 - h,
                     10 % (2 * h) < h ? 10 : 16 + 10 - h, 11 % (2 * h) < h ? 11 : 16 + 11 - h,
                     12 % (2 * h) < h ? 12 : 16 + 12 - h, 13 % (2 * h) < h ? 13 : 16 + 13 - h,
                     14 % (2 * h) < h ? 14 : 16 + 14 - h, 15 % (2 * h) < h ? 15 : 16 + 15 - h};
  constexpr i16 b = a + h;
  return __builtin_shuffle(x, y, a) + __builtin_shuffle(x, y, b);
}

// Scores of up to 16 positions of one block against one query head (float32, D a multiple of 16): each position's
// products summed lane-wise over D (one chain of multiply-adds per lane), then the 16 positions' 16 lanes summed
// at once by a transpose-reduce (4 levels, 45 vector operations for 16 scores) instead of each score's own
// horizontal sum (GCC made that a chain of 15 scalar adds per score: the kernel's largest cost, README "Scores
// sixteen at a time"). A score depends on its own position's keys only, never on which positions share its block.
template <int D>
inline v16 products(const float* qg, const float* first, int64_t row, int64_t count, int64_t jj) {
  v16 acc = {};
  if (jj < count) {
    const float* r = first + jj * row;
    for (int d = 0; d < D; d += 16)
      acc += *reinterpret_cast<const v16u*>(qg + d) * *reinterpret_cast<const v16u*>(r + d);
  }
  return acc;
}

template <int D>
inline void block_scores(const float* qg, const float* first, int64_t row, int64_t count, float* out) {
  v16 q2[4];  // folded as the positions come: at most 4 + 3 vectors live, none spilled
  for (int i = 0; i < 4; ++i) {
    const v16 a = fold<1>(products<D>(qg, first, row, count, 4 * i), products<D>(qg, first, row, count, 4 * i + 1));
    const v16 b = fold<1>(products<D>(qg, first, row, count, 4 * i + 2),
                          products<D>(qg, first, row, count, 4 * i + 3));
    q2[i] = fold<2>(a, b);
  }
  const v16 all = fold<8>(fold<4>(q2[0], q2[1]), fold<4>(q2[2], q2[3]));
  if (count == 16) {
    *reinterpret_cast<v16u*>(out) = all;
    return;
  }
  float lanes[16];
  *reinterpret_cast<v16u*>(lanes) = all;
  std::memcpy(out, lanes, count * sizeof(float));
}
#endif

// One query head's weighted sum over count positions of a block (D a multiple of 16): acc (D floats) +=
// p[j] * the value row of position j, position after position: the multiply-adds of one position at a time
// across the heads, in the same order, with the head's accumulator held in registers through the block instead
// of stored and loaded again at every position.
template <int D>
inline void block_values(const float* p, const float* first, int64_t row, int64_t count, float* acc) {
  v16 a[D / 16];
  for (int d = 0; d < D / 16; ++d) a[d] = *reinterpret_cast<const v16u*>(acc + 16 * d);
  for (int64_t j = 0; j < count; ++j) {
    const float* r = first + j * row;
    for (int d = 0; d < D / 16; ++d) a[d] += p[j] * *reinterpret_cast<const v16u*>(r + 16 * d);
  }
  for (int d = 0; d < D / 16; ++d) *reinterpret_cast<v16u*>(acc + 16 * d) = a[d];
}

// q: [B, H, D]; k, v: [slots, kvH, D] (one layer of the pool: slot = block * bs + offset); table: [B, nb] each
// session's blocks (padded); ends: [B] one past each session's last position; out: [B, H, D].
// Dh: the head size at compile time (0: at run time), so that the loops over it unroll.
template <typename T, int Dh>
void decode_attention_kernel(const T* q, const T* k, const T* v, const int64_t* table, const int64_t* ends, T* out,
                             int64_t B, int64_t H, int64_t kvH, int64_t D_, int64_t nb, int64_t bs, int64_t window,
                             float scale) {
  const int64_t D = Dh ? Dh : D_;
  const int64_t G = H / kvH;  // query heads per kv head
  const int64_t row = kvH * D;  // one slot: every kv head's row, contiguous; a block is bs such slots
  // Work items: each session's kv heads in `parts` contiguous ranges, so that a pass of fewer sessions than
  // threads (a lone decode step) still uses every thread. A head's arithmetic is the same however they split.
  const int64_t parts = std::min(kvH, std::max<int64_t>(1, (at::get_num_threads() + B - 1) / B));
  at::parallel_for(0, B * parts, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores, qf(H * D), acc(H * D);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / parts, part = item % parts;
      const int64_t h0 = part * kvH / parts, h1 = (part + 1) * kvH / parts;  // this item's kv heads
      const int64_t end = ends[b];
      const int64_t begin = window > 0 ? std::max<int64_t>(0, end - window) : 0;
      const int64_t n = end - begin;  // keys this session's query sees: positions [begin, end)
      const int64_t* blocks = table + b * nb;
      for (int64_t i = h0 * G * D; i < h1 * G * D; ++i) qf[i] = static_cast<float>(q[b * H * D + i]) * scale;
      scores.resize(H * n);  // [H, n]
      for (int64_t j0 = begin; j0 < end;) {  // scores, a block at a time
        const int64_t blk = j0 / bs, j1 = std::min(end, (blk + 1) * bs);
        const T* kb = k + (blocks[blk] - blk) * bs * row;  // position j's slot is kb + j * row
#if defined(__AVX512F__) && !defined(__clang__)  // GCC's __builtin_shuffle
        if constexpr (std::is_same_v<T, float> && Dh > 0 && Dh % 16 == 0) {
          for (int64_t a = j0; a < j1; a += 16) {  // 16 positions at a time (a block of 16: all of it)
            const int64_t count = std::min<int64_t>(16, j1 - a);
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t g = 0; g < G; ++g)
                block_scores<Dh>(qf.data() + (h * G + g) * D, kb + a * row + h * D, row, count,
                                 scores.data() + (h * G + g) * n + a - begin);
          }
          j0 = j1;
          continue;
        }
#endif
        for (int64_t j = j0; j < j1; ++j) {
          for (int64_t h = h0; h < h1; ++h) {
            const T* __restrict__ r = kb + j * row + h * D;
            for (int64_t g = 0; g < G; ++g) {
              const float* __restrict__ qg = qf.data() + (h * G + g) * D;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(r[d]);
              scores[(h * G + g) * n + j - begin] = s;
            }
          }
        }
        j0 = j1;
      }
      for (int64_t r = h0 * G; r < h1 * G; ++r) softmax_row(scores.data() + r * n, n);  // each query head's row
      std::fill(acc.begin() + h0 * G * D, acc.begin() + h1 * G * D, 0.f);
      for (int64_t j0 = begin; j0 < end;) {  // the weighted sum of values, a block at a time
        const int64_t blk = j0 / bs, j1 = std::min(end, (blk + 1) * bs);
        const T* vb = v + (blocks[blk] - blk) * bs * row;
        if constexpr (std::is_same_v<T, float> && Dh > 0 && Dh % 16 == 0) {
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t g = 0; g < G; ++g)
              block_values<Dh>(scores.data() + (h * G + g) * n + j0 - begin, vb + j0 * row + h * D, row, j1 - j0,
                               acc.data() + (h * G + g) * D);
          j0 = j1;
          continue;
        }
        for (int64_t j = j0; j < j1; ++j) {
          for (int64_t h = h0; h < h1; ++h) {
            const T* __restrict__ r = vb + j * row + h * D;
            for (int64_t g = 0; g < G; ++g) {
              const float p = scores[(h * G + g) * n + j - begin];
              float* __restrict__ a = acc.data() + (h * G + g) * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(r[d]);
            }
          }
        }
        j0 = j1;
      }
      for (int64_t i = h0 * G * D; i < h1 * G * D; ++i) out[b * H * D + i] = static_cast<T>(acc[i]);
    }
  });
}

}  // namespace

namespace stagemesh {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& ends, int64_t block_size, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q must be [B, H, D], k and v [slots, kvH, D]");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "q's heads must be a multiple of k's, D equal");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && table.is_contiguous() &&
              ends.is_contiguous(), "every tensor must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v: one dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && ends.scalar_type() == at::kLong, "table and ends must be int64");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == q.size(0) && ends.numel() == q.size(0),
              "table must be [B, nb] and ends [B]");
  TORCH_CHECK(block_size >= 1 && k.size(0) % block_size == 0, "the pool's slots must be whole blocks");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), kvH = k.size(1), nb = table.size(1);
  const int64_t* e = ends.data_ptr<int64_t>();
  const int64_t* t = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // what the kernel will read must lie in the pool
    TORCH_CHECK(e[b] >= 1 && e[b] <= nb * block_size, "session ", b, "'s end ", e[b], " is outside its block table");
    for (int64_t i = 0; i < (e[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(t[b * nb + i] >= 0 && t[b * nb + i] < k.size(0) / block_size, "block ", t[b * nb + i],
                  " is not in the pool");
  }
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto dh) {
      decode_attention_kernel<scalar_t, decltype(dh)::value>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), table.data_ptr<int64_t>(),
          ends.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, kvH, D, nb, block_size, window,
          static_cast<float>(scale));
    };
    if (D == 32) run(std::integral_constant<int, 32>{});
    else if (D == 64) run(std::integral_constant<int, 64>{});
    else if (D == 128) run(std::integral_constant<int, 128>{});
    else run(std::integral_constant<int, 0>{});
  });
  return out;
}

}  // namespace stagemesh

TORCH_LIBRARY_FRAGMENT(stagemesh, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor ends, int block_size, int window, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagemesh, CPU, m) { m.impl("decode_attention", &stagemesh::decode_attention); }
