// The entry points stagemesh's CPU kernels share with each other (each is also a torch op of the same name,
// registered in its own file): decode_layers.cpp calls the other two directly, without the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace stagemesh {

// packed_linear.cpp: x [M, K] against weights held as panels [ceil(N / 16), K, 16] (int8: [.., K + 4, 16], the
// scales after the rows), RMS-normalizing x first when norm_weight is given.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                         int64_t out_features, const std::optional<at::Tensor>& norm_weight, double eps);

// K, the input features of a Linear held as these panels.
int64_t packed_inputs(const at::Tensor& panels);

// paged_attention.cpp: one query position per session over its keys in the paged pool.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                            const at::Tensor& ends, int64_t block_size, int64_t window, double scale);

}  // namespace stagemesh
