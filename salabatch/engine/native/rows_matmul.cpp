// x · wᵀ for a few rows (a decode step's batch) on the CPU as an MLX primitive.
//
// For a float32 matmul of 2+ rows OpenBLAS packs the whole weight matrix before multiplying,
// which at a decode batch of 8 costs 2–8× the rows' arithmetic (benchmarks/README.md). Here
// each weight row is read once, straight from the weights, and multiplied with every row of x
// (held in cache, interleaved): a tile of 3 weight rows × up to 8 rows of x in registers,
// the next tile's weights prefetched meanwhile. A large weight matrix is split by its rows
// between the worker threads. mx.matmul stays the reference (tests) and the path for long
// inputs, for one row of a small weight (BLAS's matrix-vector product has no packing), and on
// every other device and dtype.

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

constexpr int kTileRows = 8;  // rows of x per tile
constexpr int kTileOut = 3;   // weight rows per tile (3 × 8 accumulators: no register spills)

float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) {
    s += v[i];
  }
  return s;
}

// x [M, K] → [K/W][M][W]: the M vectors of one step along K side by side, so a tile reads
// them at fixed offsets from one pointer.
std::vector<vf> interleave(const float* x, int M, int K) {
  std::vector<vf> xp(static_cast<size_t>(K / W) * M);
  for (int m = 0; m < M; ++m) {
    for (int k = 0; k < K; k += W) {
      xp[static_cast<size_t>(k / W) * M + m] = load(x + static_cast<size_t>(m) * K + k);
    }
  }
  return xp;
}

// y[m, o] = x[m, :] · w[o, :] for the M rows of xp (interleaved) and O weight rows, K a
// multiple of W; M fixed at compile time, so the tile is straight-line code in registers.
template <int M>
void tile_rows(const vf* xp, const float* w, float* y, int O, int K, int ldy) {
  int o = 0;
  for (; o + kTileOut <= O; o += kTileOut) {
    const float* wo = w + static_cast<size_t>(o) * K;
    vf acc[kTileOut][M] = {};
    for (int k = 0; k < K; k += W) {
      const vf* xk = xp + static_cast<size_t>(k / W) * M;
      vf wv[kTileOut];
      for (int r = 0; r < kTileOut; ++r) {
        wv[r] = load(wo + static_cast<size_t>(r) * K + k);
        // the next tile's weights, while this one computes (a hint: past the end it does nothing)
        __builtin_prefetch(wo + static_cast<size_t>(kTileOut + r) * K + k);
      }
      for (int m = 0; m < M; ++m) {
        for (int r = 0; r < kTileOut; ++r) {
          acc[r][m] += wv[r] * xk[m];
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
    vf acc[M] = {};
    for (int k = 0; k < K; k += W) {
      vf wv = load(wo + k);
      for (int m = 0; m < M; ++m) {
        acc[m] += wv * xp[static_cast<size_t>(k / W) * M + m];
      }
    }
    for (int m = 0; m < M; ++m) {
      y[static_cast<size_t>(m) * ldy + o] = hsum(acc[m]);
    }
  }
}

void tile_rows(const vf* xp, int M, const float* w, float* y, int O, int K, int ldy) {
  switch (M) {
    case 1: return tile_rows<1>(xp, w, y, O, K, ldy);
    case 2: return tile_rows<2>(xp, w, y, O, K, ldy);
    case 3: return tile_rows<3>(xp, w, y, O, K, ldy);
    case 4: return tile_rows<4>(xp, w, y, O, K, ldy);
    case 5: return tile_rows<5>(xp, w, y, O, K, ldy);
    case 6: return tile_rows<6>(xp, w, y, O, K, ldy);
    case 7: return tile_rows<7>(xp, w, y, O, K, ldy);
    default: return tile_rows<kTileRows>(xp, w, y, O, K, ldy);
  }
}

class RowsMatmul : public mx::Primitive {
 public:
  RowsMatmul(mx::Stream stream, int threads) : mx::Primitive(stream), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array &x = inputs[0], &w = inputs[1];
    mx::array& y = outputs[0];
    if (!x.flags().row_contiguous || !w.flags().row_contiguous) {
      throw std::invalid_argument("rows_matmul: x and w must be row-contiguous");
    }
    auto& encoder = encode(stream(), inputs, outputs);
    encoder.dispatch([x, w, y, threads = threads_]() mutable {
      int M = x.shape(0), K = x.shape(1), O = w.shape(0);
      int parts = w.size() >= kSplitFloats ? std::max(1, std::min(threads, O / kTileOut)) : 1;
      // part i: weight rows [O·i/parts, O·(i+1)/parts), rounded down to whole tiles
      auto edge = [&](int i) { return i == parts ? O : O * i / parts / kTileOut * kTileOut; };
      std::vector<std::vector<vf>> xp;  // each tile of rows, interleaved
      for (int m = 0; m < M; m += kTileRows) {
        xp.push_back(interleave(x.data<float>() + static_cast<size_t>(m) * K, std::min(kTileRows, M - m), K));
      }
      run_tasks(parts, threads, [&](int i) {
        int o0 = edge(i), o1 = edge(i + 1);
        for (int m = 0; m < M; m += kTileRows) {
          float* ym = y.data<float>() + static_cast<size_t>(m) * O;
          const float* wp = w.data<float>() + static_cast<size_t>(o0) * K;
          tile_rows(xp[m / kTileRows].data(), std::min(kTileRows, M - m), wp, ym + o0, o1 - o0, K, O);
        }
      });
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

  bool is_equivalent(const mx::Primitive& other) const override {
    return threads_ == static_cast<const RowsMatmul&>(other).threads_;
  }

 private:
  int threads_;
};

}  // namespace

mx::array rows_matmul(
    const mx::array& x, const mx::array& w, int threads, const mx::Stream& stream) {
  if (x.ndim() != 2 || w.ndim() != 2 || x.shape(1) != w.shape(1) || x.shape(1) % W != 0 ||
      x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("rows_matmul: float32 x [M, K] and w [O, K], K a multiple of 8");
  }
  // a weight is evaluated and row-contiguous (as loaded): read where it lies, no copy op in
  // the graph (an op each is what a few rows' product costs most on the CPU)
  bool ready = w.is_available() && w.flags().row_contiguous;
  return mx::array(
      {x.shape(0), w.shape(0)}, mx::float32, std::make_shared<RowsMatmul>(stream, threads),
      {mx::contiguous(x, false, stream), ready ? w : mx::contiguous(w, false, stream)});
}

}  // namespace salabatch
