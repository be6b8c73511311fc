// The compiled CPU kernels' entry points (panel_linear.cpp, cpu_layer.cpp), shared with their Python
// bindings (bindings.cpp). Only ATen's tensor type here: the kernels compile against ATen's few headers and
// the bindings apart from them, in parallel (torch/extension.h alone took 40 s of a 47 s build).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features);
at::Tensor panel_linear_q4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           const at::Tensor& offset, int64_t out_features);
at::Tensor panel_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           int64_t out_features);
at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels, int64_t out_features);
int64_t panel_width();

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& update,
                                     const at::Tensor& weight, double eps);
std::vector<at::Tensor> rotate_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  int64_t heads, int64_t kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
void store_kv(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& k, const at::Tensor& qkv,
              int64_t v_column, const at::Tensor& block, const at::Tensor& offset);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& table, const at::Tensor& visible, const at::Tensor& ancestors,
                           double scale);
