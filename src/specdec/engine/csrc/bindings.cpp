// The kernels' Python module (panel_linear.py's build): torch's tensor conversions and error handling
// around each entry point of kernels.h. A translation unit of its own, compiled beside the kernels'.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

#define KERNEL(name) m.def(#name, torch::wrap_pybind_function(name), #name)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  KERNEL(panel_linear);
  KERNEL(panel_linear_q4);
  KERNEL(panel_linear_q8);
  KERNEL(panel_linear_bf16);
  KERNEL(panel_width);
  KERNEL(rms_norm);
  KERNEL(add_rms_norm);
  KERNEL(rotate_qk);
  KERNEL(silu_mul);
  KERNEL(store_kv);
  KERNEL(paged_attention);
}
