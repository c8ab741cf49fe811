// The entry points of salabatch's native CPU kernels (module.cpp binds them).

#pragma once

#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace salabatch {

// InfLLM-v2 decode step (sparse_decode.cpp) → {o [B, H, 1, d], idx [B, Hk, 1, k]}.
std::vector<mx::array> sparse_decode_step(
    const mx::array& q, const mx::array& pos, const std::vector<mx::array>& c1,
    const std::vector<mx::array>& c2, const std::vector<mx::array>& shared,
    const mx::array& rows_k, const mx::array& rows_v, int start, int prefill_len, int k,
    float scale, int init_blocks, int local_blocks, int block, int stride1, int stride2,
    const mx::Stream& stream);

// x [M, K] · w [O, K]ᵀ → [M, O], float32 (rows_matmul.cpp).
mx::array rows_matmul(const mx::array& x, const mx::array& w, const mx::Stream& stream);

}  // namespace salabatch
