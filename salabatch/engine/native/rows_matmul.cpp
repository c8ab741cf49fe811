// x · wᵀ for a few rows (a decode step's batch) on the CPU as an MLX primitive.
//
// For a float32 matmul of 2+ rows OpenBLAS packs the whole weight matrix before multiplying,
// which at a decode batch of 8 costs 2–8× the rows' arithmetic (benchmarks/README.md). Here
// each weight row is read once, straight from the weights, and multiplied with every row of x
// (held in cache): a tile of 3 weight rows × 8 rows of x in registers. mx.matmul stays the
// reference (tests) and the path for one row (BLAS's matrix-vector product has no packing),
// for long inputs, and on every other device and dtype.

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "vectors.h"

namespace salabatch {
namespace {

constexpr int kTileRows = 8;  // rows of x per tile
constexpr int kTileOut = 3;   // weight rows per tile (3 × 8 accumulators: no register spills)

float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) {
    s += v[i];
  }
  return s;
}

// y[m, o] = x[m, :] · w[o, :] for m < M <= kTileRows, K a multiple of W.
void tile_rows(const float* x, const float* w, float* y, int M, int O, int K, int ldy) {
  int o = 0;
  for (; o + kTileOut <= O; o += kTileOut) {
    vf acc[kTileOut][kTileRows] = {};
    for (int k = 0; k < K; k += W) {
      vf wv[kTileOut];
      for (int r = 0; r < kTileOut; ++r) {
        wv[r] = load(w + static_cast<size_t>(o + r) * K + k);
      }
      for (int m = 0; m < kTileRows; ++m) {
        if (m < M) {
          vf xv = load(x + static_cast<size_t>(m) * K + k);
          for (int r = 0; r < kTileOut; ++r) {
            acc[r][m] += wv[r] * xv;
          }
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int r = 0; r < kTileOut; ++r) {
        y[static_cast<size_t>(m) * ldy + o + r] = hsum(acc[r][m]);
      }
    }
  }
  for (; o < O; ++o) {  // the last O % 3 weight rows
    const float* wo = w + static_cast<size_t>(o) * K;
    for (int m = 0; m < M; ++m) {
      vf acc{};
      for (int k = 0; k < K; k += W) {
        acc += load(wo + k) * load(x + static_cast<size_t>(m) * K + k);
      }
      y[static_cast<size_t>(m) * ldy + o] = hsum(acc);
    }
  }
}

class RowsMatmul : public mx::Primitive {
 public:
  explicit RowsMatmul(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    mx::array& y = outputs[0];
    if (!x.flags().row_contiguous || !w.flags().row_contiguous) {
      throw std::invalid_argument("rows_matmul: x and w must be row-contiguous");
    }
    y.set_data(mx::allocator::malloc(y.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(y);
    encoder.dispatch([x, w, y]() mutable {
      int M = x.shape(0), K = x.shape(1), O = w.shape(0);
      for (int m = 0; m < M; m += kTileRows) {
        tile_rows(
            x.data<float>() + static_cast<size_t>(m) * K, w.data<float>(),
            y.data<float>() + static_cast<size_t>(m) * O, std::min(kTileRows, M - m), O, K, O);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("rows_matmul runs on the CPU only");
  }

  // y = x wᵀ: dx = g w, dw = gᵀ x (so training through a layer that took this path works)
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums, const std::vector<mx::array>&) override {
    std::vector<mx::array> grads;
    for (int i : argnums) {
      grads.push_back(
          i == 0 ? mx::matmul(cotangents[0], primals[1], stream())
                 : mx::matmul(mx::transpose(cotangents[0], stream()), primals[0], stream()));
    }
    return grads;
  }

  const char* name() const override {
    return "RowsMatmul";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

}  // namespace

mx::array rows_matmul(const mx::array& x, const mx::array& w, const mx::Stream& stream) {
  if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1) || x.shape(1) % W != 0 ||
      x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("rows_matmul: float32 x [M, K] and w [O, K], K a multiple of 8");
  }
  return mx::array(
      {x.shape(0), w.shape(0)}, mx::float32, std::make_shared<RowsMatmul>(stream),
      {mx::contiguous(x, false, stream), mx::contiguous(w, false, stream)});
}

}  // namespace salabatch
