// What every native primitive's eval_cpu does first: allocate its outputs and register inputs
// and outputs with its stream's command encoder (which then keeps them alive until the
// dispatched task has run).

#pragma once

#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace salabatch {

inline mx::cpu::CommandEncoder& encode(
    const mx::Stream& stream, const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) {
    encoder.set_input_array(in);
  }
  for (auto& out : outputs) {
    encoder.set_output_array(out);
  }
  return encoder;
}

}  // namespace salabatch
