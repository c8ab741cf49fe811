// Stage 1 of the InfLLM-v2 decode step (stage1.h). In a decode batch over one document, most
// compressed keys belong to the shared prefix: those are scored once for every row, and their
// probabilities are taken on all rows' heads at once, so a row's G heads never leave half of a
// vector empty there.

#include "stage1.h"

#include <algorithm>
#include <cmath>

namespace salabatch {

int visible(int pos, int prefill_len, int stride) {
  int seen = (pos + 1) / stride - 1;
  if (pos < prefill_len && prefill_len >= 2 * stride) {
    seen += (prefill_len - 2 * stride) / stride + 1 - (prefill_len - stride + 1) / stride;
  }
  return std::max(seen, 0);
}

Queries::Queries(const float* q, int B, int H, int G, int d, int g, float scale)
    : B(B), G(G), d(d), nv((G + W - 1) / W), nv_all((B * G + W - 1) / W),
      all(static_cast<size_t>(d) * nv_all), rows(static_cast<size_t>(B) * d * nv) {
  for (int b = 0; b < B; ++b) {
    const float* qg = q + (static_cast<size_t>(b) * H + g * G) * d;
    for (int h = 0; h < G; ++h) {
      int lane = b * G + h;
      for (int i = 0; i < d; ++i) {
        float x = qg[static_cast<size_t>(h) * d + i] * scale;
        all[i * nv_all + lane / W][lane % W] = x;
        rows[(static_cast<size_t>(b) * d + i) * nv + h / W][h % W] = x;
      }
    }
  }
}

namespace {

// A part of the chunk axis: chunks [at, at + n), their scores from `offset` on in the level's
// shared or own buffers.
struct Segment {
  int at, n, offset;
  bool shared;
};

// One level's scores for a kv head: shared parts' with all rows' heads as the lanes
// (shared [chunks][nv_all]), each row's own parts' with its heads (own[b] [chunks][nv]).
struct Level {
  std::vector<Segment> segments;
  std::vector<vf> shared;
  std::vector<std::vector<vf>> own;
};

Level score_level(const Chunks& c, const Queries& q, int g) {
  Level l;
  int at = 0, n_shared = 0, n_own = 0;
  for (size_t p = 0; p < c.base.size(); ++p) {
    bool shared = c.row_stride[p] == 0;
    int& used = shared ? n_shared : n_own;
    l.segments.push_back({at, c.count[p], used, shared});
    used += c.count[p];
    at += c.count[p];
  }
  l.shared.resize(static_cast<size_t>(n_shared) * q.nv_all);
  l.own.assign(q.B, std::vector<vf>(static_cast<size_t>(n_own) * q.nv));
  for (size_t p = 0; p < c.base.size(); ++p) {
    const Segment& s = l.segments[p];
    const float* part = c.base[p] + g * c.head_stride[p];
    if (s.shared) {
      scores(q.all.data(), q.nv_all, q.d, part, s.n, l.shared.data() + s.offset * q.nv_all);
      continue;
    }
    for (int b = 0; b < q.B; ++b) {
      const float* row = part + static_cast<size_t>(b / c.queries) * c.row_stride[p];
      scores(q.row(b), q.nv, q.d, row, s.n, l.own[b].data() + s.offset * q.nv);
    }
  }
  return l;
}

// Per lane, how many chunks its row sees (a chunk j counts when j < limit); padding lanes 0.
std::vector<vf> lane_limits(const Queries& q, const std::vector<int>& vis, int n) {
  std::vector<vf> limit(q.nv_all, vf{});
  for (int b = 0; b < q.B; ++b) {
    for (int h = 0; h < q.G; ++h) {
      int lane = b * q.G + h;
      limit[lane / W][lane % W] = static_cast<float>(std::min(vis[b], n));
    }
  }
  return limit;
}

// The sum of row b's lanes of e, a vector's worth of heads at a time (as in its own layout).
float row_sum(const Queries& q, const vf* e, int b) {
  float total = 0.0f, part = 0.0f;
  for (int h = 0; h < q.G; ++h) {
    int lane = b * q.G + h;
    part += e[lane / W][lane % W];
    if (h % W == W - 1 || h == q.G - 1) {
      total += part;
      part = 0.0f;
    }
  }
  return total;
}

// log2 of the level-2 softmax normaliser per head, rows' own layout ([B][nv]; +inf on padding
// lanes and for a row that sees no chunk, so its probabilities are all 0), and all rows' lanes.
void level2_lse(
    const Queries& q, const Level& l2, const std::vector<vf>& limit, const std::vector<int>& vis,
    int n, bool none, std::vector<vf>& lse, std::vector<vf>& lse_all) {
  int nv = q.nv, nv_all = q.nv_all;
  // the max: shared chunks for all rows at once, then each row's own
  std::vector<vf> m_all(nv_all, splat(-kInf)), m(static_cast<size_t>(q.B) * nv);
  for (const Segment& s : l2.segments) {
    for (int j = 0; s.shared && j < s.n; ++j) {
      vf at = splat(static_cast<float>(s.at + j));
      const vf* x = l2.shared.data() + static_cast<size_t>(s.offset + j) * nv_all;
      for (int v = 0; v < nv_all; ++v) {
        m_all[v] = vmax(m_all[v], at < limit[v] ? x[v] : splat(-kInf));
      }
    }
  }
  for (int b = 0; b < q.B; ++b) {
    vf* mb = m.data() + static_cast<size_t>(b) * nv;
    take_lanes(q, m_all.data(), b, -kInf, mb);
    for (const Segment& s : l2.segments) {
      for (int j = 0; !s.shared && j < s.n && s.at + j < std::min(vis[b], n); ++j) {
        for (int u = 0; u < nv; ++u) {
          mb[u] = vmax(mb[u], l2.own[b][static_cast<size_t>(s.offset + j) * nv + u]);
        }
      }
    }
    put_lanes(q, mb, b, m_all.data());
  }
  // the sum of 2^(s - max) the same way
  std::vector<vf> t_all(nv_all, vf{});
  for (const Segment& s : l2.segments) {
    for (int j = 0; s.shared && j < s.n; ++j) {
      vf at = splat(static_cast<float>(s.at + j));
      const vf* x = l2.shared.data() + static_cast<size_t>(s.offset + j) * nv_all;
      for (int v = 0; v < nv_all; ++v) {
        t_all[v] += exp2_poly(at < limit[v] ? x[v] - m_all[v] : splat(-kInf));
      }
    }
  }
  lse.assign(static_cast<size_t>(q.B) * nv, splat(kInf));
  lse_all.assign(nv_all, splat(kInf));
  std::vector<vf> total(nv);
  for (int b = 0; b < q.B; ++b) {
    const vf* mb = m.data() + static_cast<size_t>(b) * nv;
    take_lanes(q, t_all.data(), b, 0.0f, total.data());
    for (const Segment& s : l2.segments) {
      for (int j = 0; !s.shared && j < s.n && s.at + j < std::min(vis[b], n); ++j) {
        for (int u = 0; u < nv; ++u) {
          total[u] += exp2_poly(l2.own[b][static_cast<size_t>(s.offset + j) * nv + u] - mb[u]);
        }
      }
    }
    vf* lb = lse.data() + static_cast<size_t>(b) * nv;
    for (int h = 0; h < q.G && !none && std::min(vis[b], n) > 0; ++h) {
      lb[h / W][h % W] = mb[h / W][h % W] + std::log2(total[h / W][h % W]);
    }
    put_lanes(q, lb, b, lse_all.data());
  }
}

}  // namespace

void take_lanes(const Queries& q, const vf* all, int b, float fill, vf* row) {
  std::fill(row, row + q.nv, splat(fill));
  for (int h = 0; h < q.G; ++h) {
    int lane = b * q.G + h;
    row[h / W][h % W] = all[lane / W][lane % W];
  }
}

void put_lanes(const Queries& q, const vf* row, int b, vf* all) {
  for (int h = 0; h < q.G; ++h) {
    int lane = b * q.G + h;
    all[lane / W][lane % W] = row[h / W][h % W];
  }
}

void chunk_probs(
    const Queries& q, const Chunks& c1, const Chunks& c2, int g, const std::vector<int>& vis1,
    const std::vector<int>& vis2, std::vector<std::vector<float>>& p) {
  int nv = q.nv, nv_all = q.nv_all;
  Level l1 = score_level(c1, q, g), l2 = score_level(c2, q, g);
  std::vector<vf> lse, lse_all;
  level2_lse(q, l2, lane_limits(q, vis2, c2.total), vis2, c2.total, c1.total == 0, lse, lse_all);
  std::vector<vf> limit = lane_limits(q, vis1, c1.total), e(nv_all);
  p.resize(q.B);
  for (auto& row : p) {
    row.assign(std::max(c1.total, 1), 0.0f);
  }
  for (const Segment& s : l1.segments) {
    for (int j = 0; s.shared && j < s.n; ++j) {
      vf at = splat(static_cast<float>(s.at + j));
      const vf* x = l1.shared.data() + static_cast<size_t>(s.offset + j) * nv_all;
      for (int v = 0; v < nv_all; ++v) {
        e[v] = exp2_poly(at < limit[v] ? x[v] - lse_all[v] : splat(-kInf));
      }
      for (int b = 0; b < q.B; ++b) {
        p[b][s.at + j] = row_sum(q, e.data(), b);
      }
    }
  }
  for (int b = 0; b < q.B; ++b) {
    const vf* lb = lse.data() + static_cast<size_t>(b) * nv;
    for (const Segment& s : l1.segments) {
      for (int j = 0; !s.shared && j < s.n && s.at + j < std::min(vis1[b], c1.total); ++j) {
        float total = 0.0f;
        for (int u = 0; u < nv; ++u) {
          vf x = exp2_poly(l1.own[b][static_cast<size_t>(s.offset + j) * nv + u] - lb[u]);
          float part = 0.0f;
          for (int h = 0; h < W; ++h) {
            part += x[h];
          }
          total += part;
        }
        p[b][s.at + j] = total;
      }
    }
  }
}

}  // namespace salabatch
