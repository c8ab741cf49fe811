"""`salabatch run --executor ray` on a local Ray cluster with two model actors and builtin:random
(an untrained test model): the same rows as a local run; an actor killed mid-run, its document
retried, every row once; a worker that always dies, error rows; a rerun that starts nothing; a
one-line error without Ray. Run them alone with `pytest -m ray`."""

from __future__ import annotations

import json
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason='Ray is an optional extra: pip install "salabatch[ray]"')

from salabatch.jobs.ingest import documents  # noqa: E402
from salabatch.jobs.ray.executor import SLOT, RayClusterError, _cluster, run_job_ray  # noqa: E402
from salabatch.jobs.results.read import read_results  # noqa: E402
from salabatch.jobs.results.writer import stale_rows  # noqa: E402
from salabatch.jobs.run.answerer import RunIdentity  # noqa: E402
from salabatch.jobs.run.plan import Planner  # noqa: E402
from salabatch.jobs.spec.load import load_job  # noqa: E402
from tests import REPO  # noqa: E402
from tests.jobs.ray.ray_kill import KILL_DIR, die_on_marker  # noqa: E402
from tests.jobs.run.test_runner import QUESTIONS, run_cli, write_docs, write_job  # noqa: E402

pytestmark = pytest.mark.ray

SAME = ["custom_id", "answer", "completion_tokens", "prompt_tokens", "doc_tokens", "error"]


@pytest.fixture(scope="module")
def kills(tmp_path_factory):
    """A local Ray for the module, two model slots; yields its kill folder (see die_on_marker:
    a marker there kills the worker that reads the file it names)."""
    folder = tmp_path_factory.mktemp("kills")
    ray.init(
        num_cpus=8,  # logical: Ray Data's helpers need some; the model actors take none
        resources={"salabatch_slot": 2},
        include_dashboard=False,
        logging_level="WARNING",
        # workers' own output (the tracebacks of actors these tests kill) stays in Ray's logs:
        # forwarded, it lands in whatever a later test captures
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": die_on_marker,
            # the workers import the hook from this file, and so need the repository's root
            "env_vars": {KILL_DIR: str(folder), "PYTHONPATH": str(REPO)},
        },
    )
    yield folder
    ray.shutdown()


def job_in(folder: Path, model: Path, **overrides) -> Path:
    write_docs(folder)
    return write_job(folder, model, **overrides)


def requests_in(folder: Path) -> Path:
    """Request lines: two sharing a long prefix, two short ones, one that cannot be served."""
    document = "The ferry to Eastwick leaves at 7:10 from the north quay. " * 40

    def line(custom_id: str, content: str, **body) -> str:
        messages = [{"role": "user", "content": content}]
        body = {"model": "m", "messages": messages, "max_tokens": 4, **body}
        line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
        return json.dumps(line | {"body": body})

    lines = [
        line("doc-who", f"{document}\n\nWho?"),
        line("doc-when", f"{document}\n\nWhen?"),
        line("short-1", "Name a river."),
        line("short-2", "Name a mountain."),
        line("tools", "Call one.", tools=[]),
    ]
    path = folder / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def results(folder: Path) -> list[dict]:
    table = pq.read_table(folder / "out" / "results.parquet")
    return sorted(table.to_pylist(), key=lambda r: r["custom_id"])


def test_two_actors_give_the_rows_of_a_local_run(tmp_path, tiny_model, kills):
    runs = {}
    for name, executor in [("local", []), ("ray", ["--executor", "ray", "--workers", "2"])]:
        folder = tmp_path / name
        folder.mkdir()
        job = job_in(folder, tiny_model, requests=str(requests_in(folder)))
        result = run_cli("run", str(job), *executor)
        assert result.exit_code == 3, result.output  # the line asking for tools is an error
        assert "14 rows written (1 error)" in result.output
        runs[name] = results(folder)
    expected, got = runs["local"], runs["ray"]
    assert [{c: r[c] for c in SAME} for r in got] == [{c: r[c] for c in SAME} for r in expected]
    assert [r["cache_source"] for r in got] == [r["cache_source"] for r in expected]
    assert len({r["run_id"] for r in got}) == 1


def test_a_killed_actor_has_its_document_retried_and_every_row_once(tmp_path, tiny_model, kills):
    spec = load_job(job_in(tmp_path, tiny_model))
    (kills / "report.md.once").touch()
    summary = run_job_ray(spec, workers=2, progress=False)
    assert (kills / "report.md.died").exists()  # the first attempt died
    got = results(tmp_path)
    assert summary.written == 9 and summary.errors == 0
    assert len(got) == 9 and len({r["request_key"] for r in got}) == 9
    assert all(r["status"] == "ok" for r in got)


def test_a_document_whose_worker_always_dies_becomes_error_rows(tmp_path, tiny_model, kills):
    spec = load_job(job_in(tmp_path, tiny_model))
    (kills / "letter.pdf.always").touch()
    try:
        summary = run_job_ray(spec, workers=2, progress=False, max_retries=1)
    finally:
        (kills / "letter.pdf.always").unlink()
    assert summary.written == 9 and summary.errors == 3 and summary.failed == 3
    failed = [r for r in results(tmp_path) if r["status"] == "error"]
    assert {r["doc_id"] for r in failed} == {"letter.pdf"}
    assert all(r["error"].startswith("worker failed 2 times: ") for r in failed)


def test_a_limited_run_counts_what_is_left_and_a_whole_one_says_what_it_drops(
    tmp_path, tiny_model, kills
):
    job = job_in(tmp_path, tiny_model)
    summary = run_job_ray(load_job(job), workers=2, progress=False, limit=4)
    assert (summary.written, summary.left, summary.dropped) == (4, 5, 0)
    said: list[str] = []
    fewer = write_job(tmp_path, tiny_model, questions=QUESTIONS[:2])  # "cost" is gone
    summary = run_job_ray(load_job(fewer), workers=2, progress=False, echo=said.append)
    assert (summary.left, summary.dropped) == (0, 1)  # letter.pdf's cost row
    assert f"warning: {stale_rows(1)}" in said
    assert len(results(tmp_path)) == 6


def test_a_rerun_with_nothing_to_do_starts_no_ray_and_reads_no_pdf(
    tmp_path, tiny_model, kills, monkeypatch
):
    job = job_in(tmp_path, tiny_model)
    assert run_cli("run", str(job)).exit_code == 0  # local: its rows are the ray run's too

    def refuse(*args, **kwargs):
        raise AssertionError("a rerun with nothing to do did work")

    for owner, name in [
        (ray, "init"),
        (ray.data, "from_items"),  # the pipeline: actors, models
        (documents, "read_pdf"),  # extracting a document
        (Planner, "plan"),  # tokenizing one
    ]:
        monkeypatch.setattr(owner, name, refuse)
    summary = run_job_ray(load_job(job), workers=2, progress=False)
    assert (summary.written, summary.skipped, summary.failed) == (0, 9, 0)
    assert len(read_results(tmp_path / "out" / "results.parquet")) == 9


def test_a_machine_with_other_model_files_refuses_to_start(
    tmp_path, tiny_model, kills, monkeypatch
):
    job = job_in(tmp_path, tiny_model)
    real = RunIdentity.of  # the driver's identity names other weights than the workers have

    def other(setup, config, run_id=None):
        return replace(real(setup, config, run_id), model_sha="0" * 64)

    monkeypatch.setattr(RunIdentity, "of", other)
    result = run_cli("run", str(job), "--executor", "ray", "--workers", "1")
    assert result.exit_code == 2, (result.output, repr(result.exception))
    assert "error: a model actor could not start: " in result.output
    assert "the model's files on this machine differ from the driver's" in result.output
    # one line says it: no Ray lines calling it a Ray bug, no class path, no Ray deprecations
    (said,) = [line for line in result.output.splitlines() if line.startswith(("error", "warn"))]
    assert said.startswith(f"error: a model actor could not start: {tiny_model}: the model's")


@pytest.mark.parametrize(
    "error, said",
    [
        (
            ray.exceptions.ActorUnavailableError("its worker did not register in time", None),
            "error: a model actor could not start: The actor None is unavailable: its worker",
        ),
        (
            ray.exceptions.GetTimeoutError("Timed out while starting actors.\nNot enough CPUs."),
            "error: Ray stopped the run: GetTimeoutError: Not enough CPUs.",
        ),
    ],
)
def test_a_ray_failure_of_another_kind_is_an_error_line_not_a_crash(
    tmp_path, tiny_model, kills, monkeypatch, error, said
):
    job = job_in(tmp_path, tiny_model)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ray.data.Dataset, "iter_batches", fail)
    result = run_cli("run", str(job), "--executor", "ray", "--workers", "1")
    assert result.exit_code == 2, (result.output, repr(result.exception))
    assert said in result.output


def test_executor_ray_without_ray_says_how_to_install(tmp_path, tiny_model, monkeypatch):
    job = job_in(tmp_path, tiny_model)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = run_cli("run", str(job), "--executor", "ray")
    assert result.exit_code == 2
    assert len(result.output.splitlines()) == 1
    assert 'pip install "salabatch[ray]"' in result.output


def test_ray_log_lines_go_above_the_bars_warnings_only():
    import logging

    from salabatch.jobs.ray.executor import _ray_logs

    lines: list[str] = []
    data = logging.getLogger("ray.data")
    before = list(data.handlers)
    with _ray_logs(lines.append, debug=False):
        data.info("Starting execution of Dataset dataset_0")
        data.warning("Progress bars disabled. To enable, set ...")
        logging.getLogger("ray").warning("Token authentication is enabled\n for this cluster")
        data.error("a block failed")
    assert lines == [
        "warning: ray: Token authentication is enabled for this cluster",
        "error: ray: a block failed",
    ]
    assert data.handlers == before


class _LikeRay:
    """What `_cluster` asks of Ray, and what ray.init does to SIGTERM (a handler that exits at
    once, status 15)."""

    def __init__(self) -> None:
        self.settings: dict = {}

    def is_initialized(self) -> bool:
        return False

    def init(self, **settings) -> None:
        self.settings = settings
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))

    def cluster_resources(self) -> dict:
        return {SLOT: 1}

    def shutdown(self) -> None:
        pass


def test_a_sigterm_before_rays_handler_is_in_waits_for_the_commands():
    """Ray's C++ core takes SIGTERM for a moment while ray.init runs (it aborted the driver,
    exit 134): a SIGTERM then waits, and the command's handler stops the run after."""
    import threading

    came: list[int] = []
    during: list[list[int]] = []

    class Early(_LikeRay):
        def init(self, **settings) -> None:
            # before any handler of Ray's, to the thread that starts Ray (another thread of
            # this process, Ray's own from an earlier test here, would take a process's)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
            during.append(list(came))
            super().init(**settings)

    def ours(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, ours)
    try:
        with pytest.raises(KeyboardInterrupt), _cluster(Early(), None, None, print):
            pass
        assert during == [[]] and came == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is ours
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_local_ray_is_a_new_one_and_sigterm_stays_the_commands():
    def ours(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, ours)
    try:
        like = _LikeRay()
        with _cluster(like, None, None, print) as actors:
            assert signal.getsignal(signal.SIGTERM) is ours and actors == 1
        assert like.settings["address"] == "local"  # never another Ray running here
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_while_ray_starts_stops_the_run_as_the_commands_and_shuts_ray_down():
    """Ray's own handler took a SIGTERM that came while ray.init ran: the command exited with
    status 15, nothing merged, no summary, and Ray's agents were left running."""
    import os

    class Stopped(_LikeRay):
        up = False
        shut = 0

        def init(self, **settings) -> None:
            super().init(**settings)
            self.up = True
            os.kill(os.getpid(), signal.SIGTERM)  # after Ray's handler went in

        def is_initialized(self) -> bool:
            return self.up

        def shutdown(self) -> None:
            self.shut += 1

    came: list[int] = []

    def ours(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, ours)
    try:
        like = Stopped()
        with pytest.raises(KeyboardInterrupt), _cluster(like, None, None, print):
            pass
        assert came == [signal.SIGTERM] and like.shut == 1
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("address", ["notahost", ":::", "host:0", "host:99999", "ray://h:x"])
def test_a_malformed_address_is_refused_at_once(address):
    with pytest.raises(RayClusterError, match="is not auto or HOST:PORT"):
        _cluster(_LikeRay(), address, None, print).__enter__()


def test_an_address_that_answers_but_not_as_ray_is_refused_and_rays_own_is_taken(kills):
    """A port where an HTTP server answers (a dashboard's, say): ray.init retried it for many
    minutes. The local Ray's GCS, and its client server, speak gRPC: taken."""
    import http.server
    import threading

    from salabatch.jobs.ray.executor import _reachable

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(RayClusterError, match=f"{address} answers, but not as Ray does"):
            _reachable(address)
    finally:
        server.shutdown()
    _reachable(ray.get_runtime_context().gcs_address)


def test_an_address_nothing_answers_is_refused_in_seconds_not_retried_for_minutes():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    like = _LikeRay()
    with pytest.raises(RayClusterError, match=f"cannot reach Ray at 127.0.0.1:{port}"):
        _cluster(like, f"127.0.0.1:{port}", None, print).__enter__()
    assert like.settings == {}  # refused before ray.init, which retries for ~15 minutes
