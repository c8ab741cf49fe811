// A lightning layer's recurrence fed token by token on the CPU, as one MLX primitive: the decode
// step (one token) and a verify pass (a row's newest token and its drafts) run the same loop, so
// a pass gives to the bit what decoding its tokens one by one gives.
//
// For each row b, head h and token t, with γ_h = exp(g_h):
//     S ← γ_h·S + k_t ⊗ v_t          (each product rounded, then the sum: MLX's `_advance`)
//     o_t = Σ_i (scale·q_t,i) · S_i   (i ascending)
// and the state after every token is kept (a rollback takes the one it keeps). In MLX ops the
// T tokens of a pass were ~30 ops a layer (slices, one fused update a token, a stack), ~13 µs a
// token on the 2-core CPU against ~1 µs here. gla.py's MLX-op forms are the reference (tests)
// and what every other device runs. Built without FMA contraction (CMakeLists.txt), so the
// state's arithmetic is MLX's elementwise update exactly (a rollback may replay it in MLX ops).

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "encode.h"
#include "kernels.h"
#include "mlx/primitives.h"
#include "workers.h"

namespace salabatch {
namespace {

// elements of the states a pass writes below which one thread runs it (a hand-off costs more)
constexpr size_t kSplitElements = size_t{1} << 16;

struct Dims {
  int B, H, T, dk, dv;
};

// one row and head, every token: q, k [T, dk], v [T, dv] of that row and head; s0 [dk, dv];
// states at `states` with a stride of `token_stride` floats between tokens; o [T, dv]
void run_head(
    const Dims& d, const float* q, const float* k, const float* v, float gamma, const float* s0,
    float* states, size_t token_stride, float* o, float scale) {
  std::vector<float> qs(d.dk);
  const float* prev = s0;
  for (int t = 0; t < d.T; ++t) {
    float* s = states + t * token_stride;
    const float* kt = k + static_cast<size_t>(t) * d.dk;
    const float* vt = v + static_cast<size_t>(t) * d.dv;
    for (int i = 0; i < d.dk; ++i) {
      const float ki = kt[i];
      const float* pi = prev + static_cast<size_t>(i) * d.dv;
      float* si = s + static_cast<size_t>(i) * d.dv;
      for (int j = 0; j < d.dv; ++j) {
        const float decayed = gamma * pi[j];
        const float fed = ki * vt[j];
        si[j] = decayed + fed;
      }
    }
    const float* qt = q + static_cast<size_t>(t) * d.dk;
    for (int i = 0; i < d.dk; ++i) {
      qs[i] = scale * qt[i];
    }
    float* ot = o + static_cast<size_t>(t) * d.dv;
    std::fill(ot, ot + d.dv, 0.0f);
    for (int i = 0; i < d.dk; ++i) {
      const float qi = qs[i];
      const float* si = s + static_cast<size_t>(i) * d.dv;
      for (int j = 0; j < d.dv; ++j) {
        const float term = qi * si[j];
        ot[j] = ot[j] + term;
      }
    }
    prev = s;
  }
}

class GlaSteps : public mx::Primitive {
 public:
  GlaSteps(mx::Stream stream, float scale, int threads)
      : mx::Primitive(stream), scale_(scale), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (const auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        throw std::invalid_argument("gla_steps: inputs must be row-contiguous");
      }
    }
    auto& encoder = encode(stream(), inputs, outputs);
    encoder.dispatch([q = inputs[0], k = inputs[1], v = inputs[2], gamma = inputs[3],
                      s0 = inputs[4], o = outputs[0], states = outputs[1], scale = scale_,
                      threads = threads_]() mutable {
      Dims d{q.shape(0), q.shape(1), q.shape(2), q.shape(3), v.shape(3)};
      const size_t plane = static_cast<size_t>(d.dk) * d.dv;
      const size_t token_stride = static_cast<size_t>(d.H) * plane;  // states [B, T, H, dk, dv]
      int tasks = d.B * d.H;
      int workers = states.size() >= kSplitElements ? threads : 1;
      run_tasks(tasks, workers, [&](int task) {
        int b = task / d.H, h = task % d.H;
        size_t bh = static_cast<size_t>(b) * d.H + h;
        run_head(
            d, q.data<float>() + bh * d.T * d.dk, k.data<float>() + bh * d.T * d.dk,
            v.data<float>() + bh * d.T * d.dv, gamma.data<float>()[h],
            s0.data<float>() + bh * plane,
            states.data<float>() + static_cast<size_t>(b) * d.T * token_stride + h * plane,
            token_stride, o.data<float>() + bh * d.T * d.dv, scale);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("gla_steps runs on the CPU only");
  }

  const char* name() const override {
    return "GlaSteps";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GlaSteps&>(other);
    return scale_ == o.scale_ && threads_ == o.threads_;
  }

 private:
  float scale_;
  int threads_;
};

}  // namespace

std::vector<mx::array> gla_steps(
    const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& gamma,
    const mx::array& state, float scale, int threads, const mx::Stream& stream) {
  const bool ok = q.ndim() == 4 && k.shape() == q.shape() && v.ndim() == 4 &&
                  v.shape(0) == q.shape(0) && v.shape(1) == q.shape(1) &&
                  v.shape(2) == q.shape(2) && gamma.ndim() == 1 && gamma.shape(0) == q.shape(1) &&
                  state.ndim() == 4 && state.shape(0) == q.shape(0) &&
                  state.shape(1) == q.shape(1) && state.shape(2) == q.shape(3) &&
                  state.shape(3) == v.shape(3);
  for (const auto* a : {&q, &k, &v, &gamma, &state}) {
    if (a->dtype() != mx::float32) {
      throw std::invalid_argument("gla_steps: float32 inputs");
    }
  }
  if (!ok) {
    throw std::invalid_argument(
        "gla_steps: q, k [B, H, T, dk], v [B, H, T, dv], gamma [H], state [B, H, dk, dv]");
  }
  int B = q.shape(0), H = q.shape(1), T = q.shape(2), dk = q.shape(3), dv = v.shape(3);
  std::vector<mx::array> in;
  for (const auto* a : {&q, &k, &v, &gamma, &state}) {
    in.push_back(mx::contiguous(*a, false, stream));
  }
  return mx::array::make_arrays(
      {{B, H, T, dv}, {B, T, H, dk, dv}}, {mx::float32, mx::float32},
      std::make_shared<GlaSteps>(stream, scale, threads), in);
}

}  // namespace salabatch
