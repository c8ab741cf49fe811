// Stage 1 of the InfLLM-v2 decode step for one kv head and every row of a batch (SPEC §4.3):
// the compressed keys' scores and each row's chunk probabilities, from which the step pools and
// picks blocks (sparse_decode.cpp).

#pragma once

#include <cstddef>
#include <vector>

#include "vectors.h"

namespace salabatch {

// How many compressed chunks a query at `pos` may score (sparse_select.visible_chunks).
int visible(int pos, int prefill_len, int stride);

// A part list as one chunk axis: its parts in order, each [1 or B, Hk, count, d].
struct Chunks {
  std::vector<const float*> base;
  std::vector<size_t> row_stride, head_stride;  // elements; 0 row stride: shared by every row
  std::vector<int> count;
  int total = 0;
  int queries = 1;  // query rows per row of the parts: query row b reads row b / queries
};

// The queries of one kv head's G heads, scaled (to base 2 with `scale` folded in) and
// transposed to [d][vectors]: all rows' heads as the lanes (lane b·G + h, nv_all vectors), and
// each row's own (nv vectors). Padding lanes hold 0.
struct Queries {
  Queries(const float* q, int B, int H, int G, int d, int g, float scale);
  const vf* row(int b) const {
    return rows.data() + static_cast<size_t>(b) * d * nv;
  }
  int B, G, d, nv, nv_all;
  std::vector<vf> all, rows;
};

// Row b's lanes of an all-rows array (nv_all vectors) in its own layout (nv vectors; padding
// lanes `fill`), and back.
void take_lanes(const Queries& q, const vf* all, int b, float fill, vf* row);
void put_lanes(const Queries& q, const vf* row, int b, vf* all);

// p[b][j] = sum over row b's G heads of 2^(s1_j - lse2(s2)) for its visible level-1 chunks
// (vis1[b] of them; 0 for the rest), the normaliser from the coarse level's vis2[b] (SPEC P6).
// Shared parts are scored once for all rows, their probabilities taken with all rows' heads as
// the lanes; a row's own parts with its own heads.
void chunk_probs(
    const Queries& q, const Chunks& c1, const Chunks& c2, int g, const std::vector<int>& vis1,
    const std::vector<int>& vis2, std::vector<std::vector<float>>& p);

}  // namespace salabatch
