// The entry points of salabatch's native CPU kernels (module.cpp binds them).

#pragma once

#include <cstddef>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

namespace salabatch {

// InfLLM-v2 decode step (sparse_decode.cpp) → {o [B, H, 1, d], idx [B, Hk, 1, k]}; its kv
// heads on up to `threads` threads. `dense`: every block up to each row's query instead of
// stage 1's choice (dense attention; c1, c2 may be empty). `queries` rows of q per row of keys
// (a verify pass's positions of one row).
std::vector<mx::array> sparse_decode_step(
    const mx::array& q, const mx::array& pos, const std::vector<mx::array>& c1,
    const std::vector<mx::array>& c2, const std::vector<mx::array>& shared,
    const mx::array& rows_k, const mx::array& rows_v, int start, int prefill_len, int k,
    float scale, int init_blocks, int local_blocks, int block, int stride1, int stride2,
    int threads, bool dense, int queries, const mx::Stream& stream);

// x [M, K] · w [O, K]ᵀ → [M, O], float32, on up to `threads` threads (rows_matmul.cpp): a
// weight of at least kSplitFloats floats is split between them; a smaller one takes less time
// than handing work to another thread.
constexpr size_t kSplitFloats = 1 << 17;
mx::array rows_matmul(
    const mx::array& x, const mx::array& w, int threads, const mx::Stream& stream);

// x·σ(z), or silu(z)·x with `silu` (gates.cpp), float32, z and x of one shape; a long input on
// up to `threads` threads.
mx::array gate(
    const mx::array& z, const mx::array& x, bool silu, int threads, const mx::Stream& stream);

// A lightning layer's recurrence over T tokens, token by token (gla_steps.cpp): q, k
// [B, H, T, dk], v [B, H, T, dv], gamma = exp(g) [H], state [B, H, dk, dv], all float32 →
// {o [B, H, T, dv], the state after every token [B, T, H, dk, dv]}; rows and heads on up to
// `threads` threads where the states are large.
std::vector<mx::array> gla_steps(
    const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& gamma,
    const mx::array& state, float scale, int threads, const mx::Stream& stream);

}  // namespace salabatch
