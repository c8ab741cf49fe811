"""The Ray actor of `salabatch run --executor ray`: one loaded model, answering one unit of work
(manifest.py) at a time with the local runner's own `Answerer`, its rows handed back as a table.

Ray imports this module in a fresh worker process to build the actor, and on Linux the fast
BLAS must be loaded before anything imports `mlx.core`; so nothing here imports MLX at module
level, and the actor activates the BLAS before it loads the rest.
"""

from __future__ import annotations

import pickle
import sys
from typing import TYPE_CHECKING

import pyarrow as pa

from salabatch.errors import ConfigError, error_text
from salabatch.jobs.results.schema import RESULT_SCHEMA, ResultRow
from salabatch.jobs.spec.models import JobSpec

if TYPE_CHECKING:
    from salabatch.jobs.ray.manifest import Unit


class UnitWorker:
    """Loads the job's model once; each call answers the units of a batch (one, as the
    executor sends them). A document that fails gives error rows, as in a local run; what
    kills the process is retried by Ray, and reported by the driver."""

    def __init__(self, spec: JobSpec, run_id: str, model_sha: str, debug: bool = False) -> None:
        from salabatch.engine import activate_blas

        activate_blas()
        from salabatch.engine.kernels.attention import on_gpu
        from salabatch.engine.load import load_model
        from salabatch.engine.memory import cache_limit
        from salabatch.engine.runtime import engine_runtime
        from salabatch.jobs.ray.manifest import unit_plans
        from salabatch.jobs.run.answerer import Answerer, RunIdentity
        from salabatch.jobs.run.prepare import JobSetup

        setup = JobSetup.of(spec)
        if setup.model_sha != model_sha:
            raise ConfigError(
                "the model's files on this machine differ from the driver's; give every "
                "machine the same checkpoint",
                path=setup.model_path,
                expected=model_sha[:12],
                got=setup.model_sha[:12],
            )
        model = load_model(setup.model_path, dtype=setup.dtype, tokens=setup.tok.vocab_size)
        self.setup, self.identity = setup, RunIdentity.of(setup, model.config, run_id)
        self.answerer = Answerer(
            setup, model, self.identity, progress=None, echo=_to_stderr, debug=debug
        )
        self.runtime, self.unit_plans = engine_runtime, unit_plans
        self.cache_limit = cache_limit(model.config, setup.spec.engine.prefill_chunk, on_gpu())

    def __call__(self, batch: pa.Table) -> pa.Table:
        """`batch`: a column `unit` of pickled Units -> their rows, RESULT_SCHEMA."""
        records = []
        for blob in batch.column("unit").to_pylist():
            unit = pickle.loads(blob)
            records += [row.to_record() for row in self._answer(unit)]
        return pa.Table.from_pylist(records, schema=RESULT_SCHEMA)

    def _answer(self, unit: Unit) -> list[ResultRow]:
        try:
            plans = self.unit_plans(self.setup, unit)
        except Exception as e:  # the file changed, or cannot be planned: its rows fail
            reason = f"{type(e).__name__}: {error_text(e)}"
            _to_stderr(f"error in {unit.rows[0].doc.path}: {reason}")
            return [self.identity.error_row(row, reason) for row in unit.rows]
        with self.runtime(self.cache_limit):
            return [row for rows in self.answerer.answer(plans) for row in rows]


def _to_stderr(message: str) -> None:
    """A worker's report: Ray shows a worker's stderr on the driver's terminal."""
    print(message, file=sys.stderr, flush=True)
