// Gated activations on the CPU as one MLX primitive: x·σ(z), the output gate of both attention
// kinds, and silu(z)·x = z·σ(z)·x, the MLP's SwiGLU (z its gate, x its up projection).
//
// MLX's CPU backend computes the exp of a sigmoid one element at a time, ~12 ns each: at a
// decode batch of 8 the MLP's silu alone took ~0.8 ms of a step. Here σ comes from vectors.h's
// 2^x, W lanes at a time, and a long input (a prefill chunk) is split between the threads.
// gates.py's MLX-op forms are the reference (tests) and what every other device and dtype runs.

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "encode.h"
#include "kernels.h"
#include "mlx/primitives.h"
#include "vectors.h"
#include "workers.h"

namespace salabatch {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr size_t kSpan = size_t{1} << 16;  // elements per task

// σ(z) lane by lane: e = 2^(−|z|·log2 e) ≤ 1 never overflows; σ = 1/(1 + e) for z ≥ 0 and
// e/(1 + e) below. A NaN stays NaN.
inline vf sigmoid(vf z) {
  vf e = exp2_poly((z < splat(0.0f) ? z : -z) * kLog2e);
  vf s = (z >= splat(0.0f) ? splat(1.0f) : e) / (1.0f + e);
  return z == z ? s : z;
}

inline vf gated(vf z, vf x, bool silu) {
  vf g = sigmoid(z);
  return (silu ? z * g : g) * x;
}

void gate_span(const float* z, const float* x, float* out, size_t n, bool silu) {
  size_t i = 0;
  for (; i + W <= n; i += W) {
    store(out + i, gated(load(z + i), load(x + i), silu));
  }
  if (i < n) {  // the last n % W elements, through a zero-padded vector
    float zt[W] = {}, xt[W] = {}, ot[W];
    std::memcpy(zt, z + i, (n - i) * sizeof(float));
    std::memcpy(xt, x + i, (n - i) * sizeof(float));
    store(ot, gated(load(zt), load(xt), silu));
    std::memcpy(out + i, ot, (n - i) * sizeof(float));
  }
}

class Gate : public mx::Primitive {
 public:
  Gate(mx::Stream stream, bool silu, int threads)
      : mx::Primitive(stream), silu_(silu), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &z = inputs[0], &x = inputs[1];
    mx::array& out = outputs[0];
    if (!z.flags().row_contiguous || !x.flags().row_contiguous) {
      throw std::invalid_argument("gate: z and x must be row-contiguous");
    }
    auto& encoder = encode(stream(), inputs, outputs);
    encoder.dispatch([z, x, out, silu = silu_, threads = threads_]() mutable {
      size_t n = out.size();
      int spans = static_cast<int>((n + kSpan - 1) / kSpan);
      run_tasks(spans, std::min(threads, spans), [&](int i) {
        size_t at = static_cast<size_t>(i) * kSpan, len = std::min(kSpan, n - at);
        gate_span(z.data<float>() + at, x.data<float>() + at, out.data<float>() + at, len, silu);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("gate runs on the CPU only");
  }

  // with s = σ(z): x·s gives dx = c·s, dz = c·x·s·(1 − s); z·s·x gives dx = c·z·s,
  // dz = c·x·s·(1 + z·(1 − s)) — in MLX ops, so training through it works as through the
  // reference
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    const mx::array &z = primals[0], &x = primals[1], &c = cotangents[0];
    auto st = stream();
    mx::array s = mx::sigmoid(z, st);
    mx::array one_minus = mx::subtract(mx::array(1.0f), s, st);
    std::vector<mx::array> grads;
    for (int i : argnums) {
      if (i == 1) {
        grads.push_back(mx::multiply(c, silu_ ? mx::multiply(z, s, st) : s, st));
        continue;
      }
      mx::array slope = silu_ ? mx::add(mx::array(1.0f), mx::multiply(z, one_minus, st), st)
                              : one_minus;
      grads.push_back(mx::multiply(mx::multiply(c, mx::multiply(x, s, st), st), slope, st));
    }
    return grads;
  }

  const char* name() const override {
    return "Gate";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Gate&>(other);
    return silu_ == o.silu_ && threads_ == o.threads_;
  }

 private:
  bool silu_;
  int threads_;
};

}  // namespace

mx::array gate(
    const mx::array& z, const mx::array& x, bool silu, int threads, const mx::Stream& stream) {
  if (z.shape() != x.shape() || z.dtype() != mx::float32 || x.dtype() != mx::float32) {
    throw std::invalid_argument("gate: float32 z and x of one shape");
  }
  return mx::array(
      z.shape(), mx::float32, std::make_shared<Gate>(stream, silu, threads),
      {mx::contiguous(z, false, stream), mx::contiguous(x, false, stream)});
}

}  // namespace salabatch
