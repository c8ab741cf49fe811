// The Python module of salabatch's native CPU kernels: salabatch.engine.kernels._native.

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "salabatch's native CPU kernels (MLX primitives)";
  nb::module_::import_("mlx.core");
  m.attr("mlx_version") = SALABATCH_MLX_VERSION;
  m.attr("split_floats") = salabatch::kSplitFloats;
  m.def(
      "sparse_decode_step", &salabatch::sparse_decode_step, nb::arg("q"), nb::arg("pos"),
      nb::arg("c1"), nb::arg("c2"), nb::arg("shared"), nb::arg("rows_k"), nb::arg("rows_v"),
      nb::kw_only(), nb::arg("start"), nb::arg("prefill_len"), nb::arg("k"), nb::arg("scale"),
      nb::arg("init_blocks"), nb::arg("local_blocks"), nb::arg("block"), nb::arg("stride1"),
      nb::arg("stride2"), nb::arg("threads"), nb::arg("dense"), nb::arg("queries") = 1,
      nb::arg("stream"),
      "InfLLM-v2 decode step for one query per row → (o [B, H, 1, d], idx [B, Hk, 1, k]);\n"
      "dense: every block up to the query's instead of stage 1's choice; queries: rows of q\n"
      "per row of keys.");
  m.def(
      "rows_matmul", &salabatch::rows_matmul, nb::arg("x"), nb::arg("w"), nb::kw_only(),
      nb::arg("threads"), nb::arg("stream"),
      "x [M, K] · w [O, K]ᵀ → [M, O] for a few rows, float32, on up to `threads` threads.");
  m.def(
      "gate", &salabatch::gate, nb::arg("z"), nb::arg("x"), nb::kw_only(), nb::arg("silu"),
      nb::arg("threads"), nb::arg("stream"),
      "x·σ(z), or silu(z)·x with `silu`: float32 arrays of one shape.");
  m.def(
      "gla_steps", &salabatch::gla_steps, nb::arg("q"), nb::arg("k"), nb::arg("v"),
      nb::arg("gamma"), nb::arg("state"), nb::kw_only(), nb::arg("scale"), nb::arg("threads"),
      nb::arg("stream"),
      "A lightning recurrence token by token → (o [B, H, T, dv], states [B, T, H, dk, dv]).");
}
