// InfLLM-v2 decode step on the CPU as one MLX primitive (SPEC §4.3–4.4): stage-1 scores,
// block pooling, top-k and stage-2 attention for one query per row, in one pass per
// (row, kv head) pair. A verify pass's n queries of one row of keys (its newest token and its
// drafts, each at its own position) are n rows of q that read that row's keys: each computes
// what the decode step at its position computes.
//
// The MLX-op graphs of salabatch/engine/kernels/sparse_decode.py compute the same thing and
// stay its reference (tests compare the two) and the path every other device takes. On the
// CPU those graphs run each elementwise step as a pass of its own over [rows, heads, chunks]
// scores; here, per kv head, the shared prefix's compressed keys are scored once for all rows
// (their heads as the vector lanes), each row's selection is made from scores in cache, and
// stage 2 goes block by block in ascending id over all rows (online softmax), so a block that
// several rows selected is read once while it is in cache; a shared one is scored once for all
// rows, or for two rows at a time where their heads fit one vector. The kv heads are split
// between the worker threads. In dense mode every block up to a row's query is its selection
// (no stage 1): dense attention's decode step, with the same sharing of the prefix.
//
// Layout (float32 only; the Python dispatcher sends nothing else here):
//   q        [B, H, 1, d]        H = Hk * G query heads, head h reads kv head h / G
//   pos      [B] int32           each row's query position
//   c1, c2   parts [1 or B/n, Hk, n, d], concatenated along n (shared chunks, then the rows')
//   shared   () or (k, v) [1, Hk, cap, d]: positions [0, start) common to every row
//   rows_k/v [B/n, Hk, R, d]     key row r's own positions start + 0 .. R-1, read by the
//                                query rows r·n .. r·n + n - 1 (n = `queries`, usually 1)
// → o [B, H, 1, d] float32, idx [B, Hk, 1, K] int32 (ascending, -1 padding at the end).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "encode.h"
#include "kernels.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "stage1.h"
#include "vectors.h"
#include "workers.h"


namespace {

using namespace salabatch;

constexpr float kLog2e = 1.4426950408889634f;

struct Settings {
  int H, Hk, d, K;
  int n1_parts, n2_parts;
  int start, prefill_len, init_blocks, local_blocks, block, stride1, stride2;
  float scale;
  int threads;
  bool dense;  // every block up to the query's (dense attention): no stage 1
  int queries;  // rows of q per row of keys
};

// Pooling, forcing and top-k for a query in block q_blk: the ids, ascending, -1 padded.
void select(
    const std::vector<float>& p, int n1, int q_blk, int r, const Settings& st, int32_t* out,
    std::vector<float>& pooled, std::vector<int32_t>& order) {
  int n = q_blk + 1;  // later blocks are masked to -inf and never beat these
  pooled.resize(n);
  for (int i = 0; i < n; ++i) {
    float best = -kInf;
    for (int j = std::max(r * i - 1, 0); j < std::min(r * i + r, n1); ++j) {
      best = std::max(best, p[j]);
    }
    bool forced = i < st.init_blocks || i >= q_blk - st.local_blocks;
    pooled[i] = forced ? kInf : best;
  }
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  int take = std::min(st.K, n);
  auto better = [&](int32_t a, int32_t b) {
    return pooled[a] > pooled[b] || (pooled[a] == pooled[b] && a < b);
  };
  if (take < n) {
    std::nth_element(order.begin(), order.begin() + take, order.end(), better);
  }
  std::sort(order.begin(), order.begin() + take);
  for (int i = 0; i < st.K; ++i) {
    out[i] = i < take ? order[i] : -1;
  }
}

// Dense attention's selection: every block up to q_blk, then -1.
void every_block(int q_blk, int K, int32_t* out) {
  for (int i = 0; i < K; ++i) {
    out[i] = i <= q_blk ? i : -1;
  }
}

// o[h] = o[h]·rescale[l] + sum over the n keys t of p[t][l] · v_t for the lanes l = lane0 + h,
// for d = DV·W: HB heads at a time, their outputs in registers while the values stream past
// (HB·DV = 16 vectors).
template <int DV>
void weigh(int G, int nv, const float* v, int n, const vf* p, const vf* rescale, float* o,
           int lane0) {
  constexpr int HB = DV >= 16 ? 1 : 16 / DV;
  constexpr int d = DV * W;
  for (int h0 = 0; h0 < G; h0 += HB) {
    int hb = std::min(HB, G - h0);
    vf acc[HB][DV];
    for (int h = 0; h < HB; ++h) {
      int l = lane0 + h0 + h;
      float keep = h < hb ? rescale[l / W][l % W] : 0.0f;
      for (int e = 0; e < DV; ++e) {
        acc[h][e] = h < hb ? load(o + static_cast<size_t>(h0 + h) * d + e * W) * keep : vf{};
      }
    }
    for (int t = 0; t < n; ++t) {
      vf row[DV];
      for (int e = 0; e < DV; ++e) {
        row[e] = load(v + static_cast<size_t>(t) * d + e * W);
      }
      const vf* pt = p + static_cast<size_t>(t) * nv;
      for (int h = 0; h < HB; ++h) {
        int l = lane0 + h0 + h;
        float weight = h < hb ? pt[l / W][l % W] : 0.0f;
        for (int e = 0; e < DV; ++e) {
          acc[h][e] += weight * row[e];
        }
      }
    }
    for (int h = 0; h < hb; ++h) {
      for (int e = 0; e < DV; ++e) {
        store(o + static_cast<size_t>(h0 + h) * d + e * W, acc[h][e]);
      }
    }
  }
}

// The same for any d (no fixed register tile).
void weigh_any(int G, int nv, int d, const float* v, int n, const vf* p, const vf* rescale,
               float* o, int lane0) {
  for (int h = 0; h < G; ++h) {
    float* oh = o + static_cast<size_t>(h) * d;
    int l = lane0 + h;
    float keep = rescale[l / W][l % W];
    for (int e = 0; e < d; ++e) {
      oh[e] *= keep;
    }
    for (int t = 0; t < n; ++t) {
      float weight = p[t * nv + l / W][l % W];
      for (int e = 0; e < d; ++e) {
        oh[e] += weight * v[static_cast<size_t>(t) * d + e];
      }
    }
  }
}

// The online softmax (base 2, as flash attention) over one block's scores s [n][nv]: the
// running max m and sum `total` take them in, s becomes 2^(s - max), rescale 2^(old - new max).
void softmax_block(int nv, int n, std::vector<vf>& s, vf* m, vf* total, vf* rescale) {
  for (int u = 0; u < nv; ++u) {
    vf top = m[u];
    for (int t = 0; t < n; ++t) {
      top = vmax(top, s[t * nv + u]);
    }
    rescale[u] = exp2_poly(m[u] - top);
    vf sum{};
    for (int t = 0; t < n; ++t) {
      vf e = exp2_poly(s[t * nv + u] - top);
      s[t * nv + u] = e;
      sum += e;
    }
    total[u] = total[u] * rescale[u] + sum;
    m[u] = top;
  }
}

// The unnormalised output o [G, d] of the heads in lanes lane0.. takes in n values v.
void weigh_block(int G, int nv, int d, const float* v, int n, const vf* p, const vf* rescale,
                 float* o, int lane0) {
  switch (d) {  // o kept in registers: fixed vector counts for the usual head sizes
    case 16: weigh<2>(G, nv, v, n, p, rescale, o, lane0); break;
    case 32: weigh<4>(G, nv, v, n, p, rescale, o, lane0); break;
    case 64: weigh<8>(G, nv, v, n, p, rescale, o, lane0); break;
    case 128: weigh<16>(G, nv, v, n, p, rescale, o, lane0); break;
    default: weigh_any(G, nv, d, v, n, p, rescale, o, lane0);
  }
}

// Stage 2 of one (row, kv head) pair, one selected block at a time: the scores s [n][nv] of the
// block's n visible keys update the running max m, the running sum `total` and, with its values
// v, the unnormalised output o [G, d].
void attend_block(
    int G, int nv, int d, const float* v, int n, vf* m, vf* total, float* o, std::vector<vf>& s) {
  vf rescale[4];  // nv <= 4: G <= 32 heads per kv head
  softmax_block(nv, n, s, m, total, rescale);
  weigh_block(G, nv, d, v, n, s.data(), rescale, o, 0);
}

// The same for two rows a, b that selected one whole block of the shared prefix, when their
// heads fit one vector (2G <= W): a's in lanes [0, G), b's in [G, 2G), so the block's keys are
// scored and its softmax taken once for both. `q` is their queries side by side [d]; m and
// total the running state of every row (lane r·G + h for row r's head h).
void attend_pair(int G, int d, const vf* q, const float* k, const float* v, int n, int a, int b,
                 vf* m_all, vf* total_all, float* o_a, float* o_b, std::vector<vf>& s) {
  scores(q, 1, d, k, n, s.data());
  vf m = splat(-kInf), total{}, rescale;
  for (int h = 0; h < G; ++h) {
    int la = a * G + h, lb = b * G + h;
    m[h] = m_all[la / W][la % W], m[G + h] = m_all[lb / W][lb % W];
    total[h] = total_all[la / W][la % W], total[G + h] = total_all[lb / W][lb % W];
  }
  softmax_block(1, n, s, &m, &total, &rescale);
  for (int h = 0; h < G; ++h) {
    int la = a * G + h, lb = b * G + h;
    m_all[la / W][la % W] = m[h], m_all[lb / W][lb % W] = m[G + h];
    total_all[la / W][la % W] = total[h], total_all[lb / W][lb % W] = total[G + h];
  }
  weigh_block(G, 1, d, v, n, s.data(), &rescale, o_a, 0);
  weigh_block(G, 1, d, v, n, s.data(), &rescale, o_b, G);
}

class SparseDecodeStep : public mx::Primitive {
 public:
  SparseDecodeStep(mx::Stream stream, Settings settings)
      : mx::Primitive(stream), st_(settings) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("sparse_decode_step runs on the CPU only");
  }

  const char* name() const override {
    return "SparseDecodeStep";
  }

 private:
  Settings st_;
};

void SparseDecodeStep::eval_cpu(
    const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = encode(stream(), inputs, outputs);
  for (size_t i = 2; i < inputs.size(); ++i) {
    const mx::array& a = inputs[i];
    if (a.strides(3) != 1 || (a.shape(2) > 1 && a.strides(2) != a.shape(3)) ||
        (a.shape(0) > 1 && a.strides(0) < a.shape(1) * a.strides(1))) {
      throw std::invalid_argument("sparse_decode_step: key rows must be contiguous");
    }
  }
  encoder.dispatch([inputs, o = outputs[0], idx = outputs[1], st = st_]() mutable {
    const mx::array& q = inputs[0];
    const int32_t* pos = inputs[1].data<int32_t>();
    int B = q.shape(0), G = st.H / st.Hk, d = st.d;
    Chunks c1, c2;
    size_t at = 2;
    for (int part = 0; part < st.n1_parts + st.n2_parts; ++part, ++at) {
      Chunks& c = part < st.n1_parts ? c1 : c2;
      const mx::array& a = inputs[at];
      c.base.push_back(a.data<float>());
      c.row_stride.push_back(a.shape(0) == 1 ? 0 : a.strides(0));
      c.queries = st.queries;
      c.head_stride.push_back(a.strides(1));
      c.count.push_back(a.shape(2));
      c.total += inputs[at].shape(2);
    }
    const float *shared_k = nullptr, *shared_v = nullptr;
    size_t shared_head = 0;
    if (st.start > 0) {
      shared_k = inputs[at].data<float>();
      shared_v = inputs[at + 1].data<float>();
      shared_head = inputs[at].strides(1);
      at += 2;
    }
    const mx::array& keys = inputs[at];
    const float* rows_k = keys.data<float>();
    const float* rows_v = inputs[at + 1].data<float>();
    size_t row_stride = keys.strides(0), head_stride = keys.strides(1);

    int nv = (G + W - 1) / W, nv_all = (B * G + W - 1) / W;
    int r = st.block / st.stride1, S = st.start / st.block;
    float qscale = st.scale * kLog2e;
    // row b's selection and output for kv head g
    auto selection = [&](int b, int g) {
      return idx.data<int32_t>() + (static_cast<size_t>(b) * st.Hk + g) * st.K;
    };
    auto output = [&](int b, int g) {
      return o.data<float>() + (static_cast<size_t>(b) * st.H + g * G) * d;
    };
    // one task per kv head: its rows' selections and outputs are its own
    run_tasks(st.Hk, st.threads, [&](int g) {
      std::vector<vf> s(static_cast<size_t>(st.block) * nv);
      std::vector<vf> s_all(static_cast<size_t>(st.block) * nv_all);
      std::vector<int> who;  // the rows that take in the current block
      std::vector<std::vector<float>> p;
      std::vector<float> pooled;
      std::vector<int32_t> order;
      // the online softmax's running max and sum, all rows' heads as the lanes (as qs.all)
      std::vector<vf> m_all(nv_all, splat(-kInf)), total_all(nv_all, vf{});
      std::vector<vf> m_new(nv_all), total_new(nv_all), rescale_all(nv_all);
      std::vector<int> next(B), vis1(B), vis2(B);
      Queries qs(q.data<float>(), B, st.H, G, d, g, qscale);
      for (int b = 0; b < B; ++b) {
        vis1[b] = visible(pos[b], st.prefill_len, st.stride1);
        vis2[b] = visible(pos[b], st.prefill_len, st.stride2);
      }
      if (!st.dense) {
        chunk_probs(qs, c1, c2, g, vis1, vis2, p);
      }
      // where two rows' heads fit one vector: each row's queries moved up to lanes [G, 2G)
      std::vector<vf> high, pair_q(d);
      if (2 * G <= W) {
        high.assign(static_cast<size_t>(B) * d, vf{});
        for (int b = 0; b < B; ++b) {
          for (int i = 0; i < d; ++i) {
            for (int h = 0; h < G; ++h) {
              high[static_cast<size_t>(b) * d + i][G + h] = qs.row(b)[i][h];
            }
          }
        }
      }
      for (int b = 0; b < B; ++b) {
        int32_t* sel = selection(b, g);
        if (st.dense) {
          every_block(pos[b] / st.block, st.K, sel);
        } else {
          select(p[b], c1.total, pos[b] / st.block, r, st, sel, pooled, order);
        }
        float* og = output(b, g);
        std::fill(og, og + static_cast<size_t>(G) * d, 0.0f);
        next[b] = 0;
      }
      // stage 2, block by block in ascending id over all rows: a shared block is read once
      // while every row that selected it takes it in
      constexpr int kNone = std::numeric_limits<int>::max();
      auto next_block = [&]() {  // the lowest block id a row has still to take in
        int u = kNone;
        for (int b = 0; b < B; ++b) {
          const int32_t* sel = selection(b, g);
          if (next[b] < st.K && sel[next[b]] >= 0) {
            u = std::min(u, static_cast<int>(sel[next[b]]));
          }
        }
        return u;
      };
      for (int u = next_block(), u_next = kNone; u != kNone; u = u_next) {
        who.clear();
        for (int b = 0; b < B; ++b) {
          const int32_t* sel = selection(b, g);
          if (next[b] < st.K && sel[next[b]] == u) {
            ++next[b];
            who.push_back(b);
          }
        }
        size_t first = static_cast<size_t>(u) * st.block;
        u_next = next_block();
        if (u_next < S) {  // its keys and values on their way from memory while u is computed
          size_t at = g * shared_head + static_cast<size_t>(u_next) * st.block * d;
          for (size_t i = 0; i < static_cast<size_t>(st.block) * d; i += 64 / sizeof(float)) {
            __builtin_prefetch(shared_k + at + i);
            __builtin_prefetch(shared_v + at + i);
          }
        }
        // A block of the shared prefix is whole for every row (all its keys are before each
        // row's query). Scored once with all rows' heads as the lanes when that takes no more
        // vectors than scoring it for each selecting row (whose G heads may fill half of one).
        bool together = u < S && who.size() * nv >= static_cast<size_t>(nv_all);
        // a block of the shared prefix: where its keys and values lie (else in each row's own)
        const float* shared_kb = u < S ? shared_k + g * shared_head + first * d : nullptr;
        const float* shared_vb = u < S ? shared_v + g * shared_head + first * d : nullptr;
        if (together) {  // one softmax on all lanes; a row's lanes are kept if it selected u
          scores(qs.all.data(), nv_all, d, shared_kb, st.block, s_all.data());
          m_new = m_all, total_new = total_all;
          softmax_block(nv_all, st.block, s_all, m_new.data(), total_new.data(),
                        rescale_all.data());
          for (int b : who) {
            weigh_block(G, nv_all, d, shared_vb, st.block, s_all.data(), rescale_all.data(),
                        output(b, g), b * G);
            for (int h = 0; h < G; ++h) {
              int lane = b * G + h;
              m_all[lane / W][lane % W] = m_new[lane / W][lane % W];
              total_all[lane / W][lane % W] = total_new[lane / W][lane % W];
            }
          }
          continue;
        }
        // the rest of a shared block's rows two at a time where their heads fit one vector
        size_t single = 0;
        if (u < S && 2 * G <= W) {
          for (; single + 1 < who.size(); single += 2) {
            int a = who[single], b = who[single + 1];
            for (int i = 0; i < d; ++i) {
              pair_q[i] = qs.row(a)[i] + high[static_cast<size_t>(b) * d + i];
            }
            attend_pair(G, d, pair_q.data(), shared_kb, shared_vb, st.block, a, b, m_all.data(),
                        total_all.data(), output(a, g), output(b, g), s);
          }
        }
        for (size_t j = single; j < who.size(); ++j) {
          int b = who[j];
          const float *k = shared_kb, *v = shared_vb;
          if (u >= S) {
            size_t own = static_cast<size_t>(b / st.queries) * row_stride + g * head_stride +
                         (first - st.start) * d;
            k = rows_k + own;
            v = rows_v + own;
          }
          int n = std::min(st.block, pos[b] + 1 - u * st.block);
          vf m[4], total[4];  // nv <= 4
          take_lanes(qs, m_all.data(), b, -kInf, m);
          take_lanes(qs, total_all.data(), b, 0.0f, total);
          scores(qs.row(b), nv, d, k, n, s.data());
          attend_block(G, nv, d, v, n, m, total, output(b, g), s);
          put_lanes(qs, m, b, m_all.data());
          put_lanes(qs, total, b, total_all.data());
        }
      }
      for (int b = 0; b < B; ++b) {
        float* og = output(b, g);
        for (int h = 0; h < G; ++h) {
          int lane = b * G + h;
          float inv = 1.0f / total_all[lane / W][lane % W];
          for (int e = 0; e < d; ++e) {
            og[static_cast<size_t>(h) * d + e] *= inv;
          }
        }
      }
    });
  });
}

}  // namespace

std::vector<mx::array> salabatch::sparse_decode_step(
    const mx::array& q, const mx::array& pos, const std::vector<mx::array>& c1,
    const std::vector<mx::array>& c2, const std::vector<mx::array>& shared,
    const mx::array& rows_k, const mx::array& rows_v, int start, int prefill_len, int k,
    float scale, int init_blocks, int local_blocks, int block, int stride1, int stride2,
    int threads, bool dense, int queries, const mx::Stream& stream) {
  int B = q.shape(0), H = q.shape(1), d = q.shape(3), Hk = rows_k.shape(1);
  if (q.shape(2) != 1 || H % Hk != 0 || (start > 0) != (shared.size() == 2)) {
    throw std::invalid_argument("sparse_decode_step: q [B, H, 1, d] and (k, v) iff start > 0");
  }
  if (queries < 1 || B != rows_k.shape(0) * queries) {
    throw std::invalid_argument("sparse_decode_step: q must have `queries` rows per key row");
  }
  if (block % stride1 != 0 || start % block != 0 || H / Hk > 4 * W) {
    throw std::invalid_argument("sparse_decode_step: block geometry (SPEC P14)");
  }
  Settings st{H, Hk, d, k, static_cast<int>(c1.size()), static_cast<int>(c2.size()),
              start, prefill_len, init_blocks, local_blocks, block, stride1, stride2, scale,
              threads, dense, queries};
  std::vector<mx::array> inputs;
  auto add = [&](const mx::array& a, mx::Dtype dtype, bool copy) {
    if (a.dtype() != dtype || (dtype == mx::float32 && (a.ndim() != 4 || a.shape(3) != d))) {
      throw std::invalid_argument("sparse_decode_step: float32 [., ., ., d] arrays, int32 pos");
    }
    inputs.push_back(copy ? mx::contiguous(a, false, stream) : a);
  };
  add(q, mx::float32, true);
  add(pos, mx::int32, true);
  // buffers and their slices are read where they lie (eval checks each row is contiguous)
  for (const auto& part : c1) add(part, mx::float32, false);
  for (const auto& part : c2) add(part, mx::float32, false);
  for (const auto& part : shared) add(part, mx::float32, false);
  add(rows_k, mx::float32, false);
  add(rows_v, mx::float32, false);
  return mx::array::make_arrays(
      {{B, H, 1, d}, {B, Hk, 1, k}}, {mx::float32, mx::int32},
      std::make_shared<SparseDecodeStep>(stream, st), inputs);
}
