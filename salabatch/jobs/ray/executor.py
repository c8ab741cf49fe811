"""`salabatch run --executor ray`: one job across the machines of a Ray cluster, the document
the unit of work.

The driver (where the command runs) lists the job's units (manifest.py) without loading the
model: one unit per file, whose documents keep all their questions together, and the request
lines in prefix groups. Units whose rows are all in the results are left out, so a rerun with
nothing to do starts no Ray at all. A Ray Data pipeline maps each unit to an actor holding the
model (worker.py: loaded once per actor, placed by the custom resource `salabatch_slot`,
which each machine offers as many times as it should hold models: once by default); the actor
prefills each document once and answers its questions there, in batches. A document is never
split across machines; what scales is the number of documents done at once.

The rows come back to the driver, which writes them with the local executor's durable
ResultWriter as each unit arrives, not with Ray's write_parquet: across machines without a
shared file system, write_parquet to a local path lands on each worker's own disk. Rows are
small (answers), and one writer on the driver keeps what a local run gives: each row once by
request_key, the run lock, resume, dropping rows no longer in the job, and the same single
results file, so a job run here and on a cluster compares one file with another.

Faults: Ray restarts an actor that dies and retries its unit on it, at most `max_retries`
times; a unit that still fails is dropped from the pipeline (Ray Data's max_errored_blocks)
and the driver writes error rows for the rows that did not come back. The prefix store is the
job's `cache.dir` on each machine (shared, if it points at a shared file system), so a retried
document finds the prefix or snapshot its first attempt saved on the same machine or store.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from salabatch.engine.config import ModelConfig
from salabatch.errors import SalabatchError, error_text
from salabatch.jobs.ray.manifest import Unit, plan_manifest
from salabatch.jobs.results.export import export_openai_jsonl
from salabatch.jobs.results.schema import ResultRow
from salabatch.jobs.results.writer import ResultWriter, stale_rows
from salabatch.jobs.run.answerer import RunIdentity
from salabatch.jobs.run.plan import Row
from salabatch.jobs.run.prepare import prepared
from salabatch.jobs.run.progress import Progress
from salabatch.jobs.run.runner import RunSummary, count_rows, cut_short
from salabatch.jobs.spec.models import JobSpec

SLOT = "salabatch_slot"  # the custom resource an actor takes one of: a model on that machine
INSTALL = 'pip install "salabatch[ray]"'
# A local Ray gets this many logical CPUs at least: the actors take none, Ray Data's own
# tasks and helper actors need some, and with too few (2) the pipeline was seen to deadlock.
LOCAL_CPUS = 8
RAY_DATA_ERRORS = "ray.data._internal.execution.streaming_executor_state"
REACH_S = 10  # seconds to wait for a cluster's address to answer


class RayNotInstalled(SalabatchError):
    """`--executor ray` where Ray is not installed."""

    exit_code = 2


class RayClusterError(SalabatchError):
    """A Ray cluster that cannot be reached, or that offers no `salabatch_slot`."""

    exit_code = 2


def run_job_ray(
    spec: JobSpec,
    *,
    address: str | None = None,
    workers: int | None = None,
    resume: bool = True,
    retry_errors: bool = False,
    limit: int | None = None,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    debug: bool = False,
    max_retries: int = 2,
    jsonl: Path | None = None,
) -> RunSummary:
    """Runs the job on Ray as `run_job` runs it locally; returns what was done.

    address: None starts a local Ray (`workers` actors, 1 by default) unless this process is
        connected already; "auto" or "HOST:PORT" joins a running cluster.
    workers: at most this many model actors (default: one per `salabatch_slot` offered).
    max_retries: times a unit whose actor died is tried again before its rows become errors.
    Raises RayNotInstalled without Ray, RayClusterError for a cluster it cannot use.
    """
    ray = _import_ray()
    start = time.perf_counter()
    summary = RunSummary(str(spec.output.path))
    try:
        limited = limit is not None
        with prepared(
            spec, resume=resume, retry_errors=retry_errors, limited=limited, echo=echo
        ) as (writer, setup):
            summary.skipped = len(writer.done_keys())  # until the manifest counts the job's
            manifest = plan_manifest(setup, writer.done_keys(), limit)
            identity = RunIdentity.of(setup, ModelConfig.from_file(setup.model_path))
            summary.skipped, summary.documents = manifest.skipped, manifest.documents
            summary.requests = manifest.requests
            shown = Progress.to(
                sys.stderr, spec.name, count_rows(spec), enabled=progress, echo=echo
            )
            try:
                shown.found_done(manifest.skipped)
                out = _Output(writer, summary, identity, shown)
                for plan in manifest.errors:  # request lines that cannot be served
                    out.fail(plan.rows, plan.error)
                if manifest.units:
                    with (
                        _ray_logs(shown.write, debug),
                        _cluster(ray, address, workers, shown.write, debug) as actors,
                    ):
                        dropped = _run(ray, manifest.units, actors, spec, out, debug, max_retries)
                    reason = _failure_reason(dropped, max_retries)
                    out.fail([row for unit in manifest.units for row in unit.rows], reason)
            finally:
                shown.close()
            if manifest.complete:
                # Rows of earlier runs outside the job go when the writer closes.
                job = frozenset(manifest.job_keys)
                summary.dropped = writer.retain(job)
                if summary.dropped:
                    echo(f"warning: {stale_rows(summary.dropped)}")
            else:  # --limit: counted as the local runner counts it
                job = cut_short(setup, writer, summary)
            summary.failed = len(job & writer.failed_keys())
        if jsonl is not None:  # from the merged results, earlier runs' rows included
            export_openai_jsonl(spec.output.path, jsonl, lines=manifest.request_lines)
    except KeyboardInterrupt:
        summary.interrupted = True
    summary.seconds = time.perf_counter() - start
    return summary


def _import_ray() -> ModuleType:
    try:
        import ray
        import ray.data  # noqa: F401  (the [data] extra)
    except ImportError as e:
        raise RayNotInstalled(
            f"--executor ray needs Ray Data, which is not installed ({e.name or e}): {INSTALL}"
        ) from None
    return ray


@contextmanager
def _cluster(
    ray: ModuleType,
    address: str | None,
    workers: int | None,
    echo: Callable[[str], None],
    debug: bool = False,
) -> Iterator[int]:
    """Ray for the block: the connection this process has, or a local Ray started (and shut
    down after) when `address` is None, or the cluster at `address`. Yields how many model
    actors to run. The workers' own output stays in Ray's logs unless `debug` (the driver
    reports each failed document itself)."""
    started = not ray.is_initialized()
    # ray.init puts in a SIGTERM handler of its own that exits at once (status 15, the rows
    # finished not merged): the command's own (SIGTERM as Ctrl-C) goes back after it, and a
    # SIGTERM that Ray's took while it started is given to the command's (`_started`)
    terminate = signal.getsignal(signal.SIGTERM)
    try:  # Ray shut down however its start ends (Ctrl-C mid-start left its agents running)
        if started:
            _started(ray, address, workers, debug, terminate)
        slots = int(ray.cluster_resources().get(SLOT, 0))
        if slots == 0:
            raise RayClusterError(
                f"no machine of the Ray cluster offers the {SLOT} resource; start each with "
                f"`ray start ... --resources='{{\"{SLOT}\": 1}}'`"
            )
        if workers is not None and workers > slots:
            echo(f"note: --workers {workers}, but the cluster offers {slots} {SLOT}: {slots}")
        yield min(workers or slots, slots)
    finally:
        if started and ray.is_initialized():
            ray.shutdown()


def _started(ray, address: str | None, workers: int | None, debug: bool, terminate) -> None:
    """`ray.init`: a local Ray started (`address` None) or the cluster at `address` joined;
    then the command's SIGTERM handler `terminate` back in place of Ray's. SIGTERM waits while
    Ray starts (its C++ core's handler, in place for a moment, aborted the driver: exit 134,
    nothing merged), and stops the run once the command's handler is back."""
    held = threading.current_thread() is threading.main_thread()
    if held:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        if address is None:
            cpus = max(LOCAL_CPUS, os.cpu_count() or 1)
            ray.init(
                address="local",  # a new Ray here, even where another already runs
                num_cpus=cpus,
                resources={SLOT: workers or 1},
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=debug,
            )
        else:
            _reachable(address)
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=debug)
            except ConnectionError as e:
                message = f"cannot connect to Ray at {address}: {error_text(e)}"
                raise RayClusterError(message) from e
    except SystemExit as e:  # Ray's handler took a SIGTERM that came while it started
        if e.code != signal.SIGTERM or not callable(terminate):
            raise
        terminate(signal.SIGTERM, None)  # the command's: as Ctrl-C, the run stops cleanly
        raise
    finally:
        if held:
            signal.signal(signal.SIGTERM, terminate)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # one that came: now


def _reachable(address: str) -> None:
    """RayClusterError unless `address` ("auto", or [ray://]HOST:PORT) is well formed and, for a
    host and port, something listens there and speaks gRPC, as Ray does: Ray itself retries
    an address nothing answers, or something else does, for a quarter of an hour."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: [::1]:6379
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayClusterError(
            f"--address {address!r} is not auto or HOST:PORT (as ray start prints it, "
            "e.g. 10.0.0.5:6379, or ray://HOST:PORT for a Ray client server)"
        )
    tls = os.environ.get("RAY_USE_TLS", "0").lower() not in ("0", "false")  # no plain probe
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_S) as conn:
            ray_there = tls or _speaks_grpc(conn)
    except OSError as e:
        raise RayClusterError(f"cannot reach Ray at {address}: {error_text(e)}") from None
    if not ray_there:
        raise RayClusterError(
            f"{address} answers, but not as Ray does (no gRPC there: a dashboard's port, say); "
            "give the address `ray start --head` prints, e.g. 10.0.0.5:6379"
        )


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, its client
# server) answers with its own SETTINGS frame (type 4 on stream 0)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(conn: socket.socket) -> bool:
    """Whether the server at the end of `conn` speaks HTTP/2, as gRPC does (Ray's GCS, which
    `ray.init` would otherwise retry for minutes on a port that answers something else);
    OSError where it says nothing within the connection's timeout."""
    conn.sendall(_H2_PREFACE)
    head = b""
    while len(head) < 9 and (got := conn.recv(9 - len(head))):
        head += got
    return len(head) == 9 and head[3] == 4 and head[5:9] == bytes(4)


def _run(
    ray: ModuleType,
    units: list[Unit],
    actors: int,
    spec: JobSpec,
    out: _Output,
    debug: bool,
    max_retries: int,
) -> list[str]:
    """Maps the units over `actors` model actors and writes their rows as they arrive;
    returns the kinds of error of the units Ray Data dropped, which no attempt finished."""
    from ray.data import ActorPoolStrategy

    from salabatch.jobs.ray.worker import UnitWorker

    items = [{"unit": pickle.dumps(unit)} for unit in units]
    with warnings.catch_warnings(), _dropped_units() as dropped:
        # Ray's own settings it deprecates (its DataContext's, as it copies them): nothing a
        # user of salabatch can change
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray(\.|$)")
        # max_task_retries has no named parameter yet; Ray Data passes it to the actors
        warnings.filterwarnings("ignore", message=".*ray_remote_args.* is deprecated")
        data = ray.data.from_items(items, override_num_blocks=len(items))  # a block per unit
        answered = data.map_batches(
            UnitWorker,
            batch_size=1,
            batch_format="pyarrow",
            compute=ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            fn_constructor_kwargs={
                "spec": spec,
                "run_id": out.identity.run_id,
                "model_sha": out.identity.model_sha,
                "debug": debug,
            },
            num_cpus=0,  # the actor is placed by SLOT; its BLAS and MLX use the machine
            resources={SLOT: 1},
            max_task_retries=max_retries,
        )
        answered.context.max_errored_blocks = -1  # a unit that failed every try: error rows
        answered.context.enable_progress_bars = False  # the driver shows its own, in rows
        try:
            for table in answered.iter_batches(batch_size=None, batch_format="pyarrow"):
                out.write([ResultRow.from_record(r) for r in table.to_pylist()])
        except ray.exceptions.RayActorError as e:  # dropped blocks aside, only a failed start
            raise RayClusterError(f"a model actor could not start: {_last_line(e)}") from None
        except ray.exceptions.RayError as e:  # Ray's own failure: the rows written stay
            raise RayClusterError(
                f"Ray stopped the run: {type(e).__name__}: {_last_line(e)}"
            ) from None
    return dropped


def _last_line(error: Exception) -> str:
    """The last line of a Ray error's text: the constructor's or the task's own error, as a
    local run says it (salabatch's own by its message, another by its class's name alone)."""
    lines = str(error).strip().splitlines()
    last = lines[-1].strip() if lines else "no message"
    return re.sub(r"^salabatch\.errors\.\w+: |^(?:\w+\.)+(?=\w+: )", "", last)


# Ray Data's lines that say nothing to a salabatch user: that its own bars are off (the driver
# turned them off, for its own); an actor's failed start, which the run's error line names,
# said as a Ray bug whose stack trace does not follow
_RAY_NOISE = (
    "Progress bars disabled",
    "actors died during initialization",
    "Exception occurred in Ray Data or Ray Core internal code",
    "Full stack trace:",
)


@contextmanager
def _ray_logs(write: Callable[[str], None], debug: bool) -> Iterator[None]:
    """Ray's console log lines, for the block, through `write` (above the bars, never through
    them), as `warning: ray: ...` lines: warnings and errors only, unless `debug` (Ray Data's
    INFO lines on its execution plan stay in its log files). Ray's own console handlers are
    put back after."""

    class Through(logging.Handler):
        last: logging.LogRecord | None = None

        def emit(self, record: logging.LogRecord) -> None:
            if record is self.last:  # `ray.data` passed it on to `ray` too
                return
            self.last = record
            message = " ".join(record.getMessage().split())
            if debug or not any(noise in message for noise in _RAY_NOISE):
                kind = "warning" if record.levelno < logging.ERROR else "error"
                write(f"{kind}: ray: {message}")

    through = Through(logging.DEBUG if debug else logging.WARNING)
    saved = []
    for name in ("ray", "ray.data"):
        logger = logging.getLogger(name)
        consoles = [h for h in logger.handlers if type(h) is not logging.FileHandler]
        consoles = [h for h in consoles if isinstance(h, logging.StreamHandler)]
        for handler in consoles:
            logger.removeHandler(handler)
        logger.addHandler(through)
        saved.append((logger, consoles))
    try:
        yield
    finally:
        for logger, consoles in saved:
            logger.removeHandler(through)
            for handler in consoles:
                logger.addHandler(handler)


@contextmanager
def _dropped_units() -> Iterator[list[str]]:
    """The kind of error (its class name) of each block Ray Data drops in the block."""
    dropped: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                dropped.append(type(record.exc_info[1]).__name__)

    logger, handler = logging.getLogger(RAY_DATA_ERRORS), Collect(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield dropped
    finally:
        logger.removeHandler(handler)


def _failure_reason(dropped: list[str], max_retries: int) -> str:
    """The error of the rows of a unit that no attempt finished."""
    kinds = ", ".join(sorted(set(dropped))) or "no result"
    return (
        f"worker failed {max_retries + 1} times: {kinds} (its process died or its machine was "
        "lost; see the Ray logs)"
    )


class _Output:
    """The driver's side of the results: writes each row once, counts it, shows it, and names
    each document (or request line) whose rows fail, in one line."""

    def __init__(
        self, writer: ResultWriter, summary: RunSummary, identity: RunIdentity, shown: Progress
    ) -> None:
        self.writer, self.summary, self.identity, self.shown = writer, summary, identity, shown
        self.keys: set[str] = set()  # written by this run
        self.named: set[str] = set()  # failed documents and request lines reported

    def write(self, rows: list[ResultRow]) -> None:
        rows = [row for row in rows if row.request_key not in self.keys]
        if not rows:
            return
        self.writer.write(rows)
        self.keys.update(row.request_key for row in rows)
        self.summary.written += len(rows)
        self.summary.errors += sum(row.status == "error" for row in rows)
        for row in rows:
            name = _row_name(row)
            if row.status == "error" and name not in self.named:
                self.named.add(name)
                self.shown.write(f"error in {name}: {row.error}")
        self.shown.rows(len(rows))

    def fail(self, rows: Iterable[Row], reason: str) -> None:
        """Error rows for those of `rows` that this run has not written."""
        self.write([self.identity.error_row(r, reason) for r in rows if r.key not in self.keys])


def _row_name(row: ResultRow) -> str:
    """What a failed row is of, as a report names it: its request line, or its document."""
    if row.request_line is not None:
        return f"request {row.custom_id}"
    return f"document {row.doc_id}"
