// Float vectors for the native kernels: W lanes through GCC/Clang vector extensions (AVX on
// x86, NEON pairs on arm64), 2^x on them, and the score loop every kernel here is built on.

#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace salabatch {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Queries are the lanes (a pair's G heads, padded to whole vectors, or every row's heads), so
// scores need no horizontal sums: a key row's element i is broadcast and multiplies every
// lane's q[i] at once.
constexpr int W = 8;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) {
  std::memcpy(p, &v, sizeof(v));
}

inline vf splat(float x) {
  return vf{} + x;
}

inline vf vmax(vf a, vf b) {
  return a > b ? a : b;
}

// 2^x for x <= 0 (-inf gives 0), lane by lane: the polynomial of attention.exp2_poly (Cephes'
// exp2f coefficients on [-1/2, 1/2]) times 2^round(x) built in the exponent bits.
inline vf exp2_poly(vf x) {
  x = vmax(x, splat(-127.0f));
  vf i = (x + 12582912.0f) - 12582912.0f;
  vf f = x - i;
  vf p = 1.0f +
      f * (0.6931472028550421f +
           f * (0.2402264791363012f +
                f * (0.05550332471162809f +
                     f * (0.009618437357674640f +
                          f * (0.001339887440266574f + f * 0.0001535336188319500f)))));
  vi bits = (__builtin_convertvector(i, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out[t·nv + v] = rows[t] · qt (lanes of vector v) for n rows of d floats at `rows` (stride
// d); qt [d][nv] vectors: the transposed, scaled queries. Eight rows at a time: eight
// independent multiply-add chains keep the vector units busy.
inline void scores(const vf* qt, int nv, int d, const float* rows, int n, vf* out) {
  constexpr int U = 8;
  int t = 0;
  for (; t + U <= n; t += U) {
    const float* r = rows + static_cast<size_t>(t) * d;
    for (int v = 0; v < nv; ++v) {
      vf acc[U] = {};
      for (int i = 0; i < d; ++i) {
        vf q = qt[i * nv + v];
        for (int u = 0; u < U; ++u) {
          acc[u] += r[u * d + i] * q;
        }
      }
      for (int u = 0; u < U; ++u) {
        out[(t + u) * nv + v] = acc[u];
      }
    }
  }
  for (; t < n; ++t) {
    const float* r = rows + static_cast<size_t>(t) * d;
    for (int v = 0; v < nv; ++v) {
      vf acc{};
      for (int i = 0; i < d; ++i) {
        acc += r[i] * qt[i * nv + v];
      }
      out[t * nv + v] = acc;
    }
  }
}

}  // namespace salabatch
