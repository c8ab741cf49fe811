"""The durable writer: merging, resume, --no-resume, and SIGKILL at any moment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from salabatch.errors import OutputError
from salabatch.jobs.results.read import read_metadata, read_results
from salabatch.jobs.results.schema import SCHEMA_VERSION, current_versions
from tests import REPO
from tests.jobs.results.test_results import SPEC, VERSIONS, keys_of, make_row, writer

# --- writing, merging, metadata --------------------------------------------------------------


def test_batches_merge_into_one_file_with_metadata(tmp_path):
    path = tmp_path / "out" / "r.parquet"  # the folder is created
    with writer(path) as out:
        out.write([make_row("b.q0"), make_row("b.q1")])
        out.write([])
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
        parts = sorted(p.name for p in out.parts_dir.glob("part-*"))
        assert parts[0].startswith("part-000001-") and parts[1].startswith("part-000002-")
        assert not path.exists()
        assert keys_of(read_results(path)) == ["a.q0", "a.q1", "b.q0", "b.q1"]  # mid-run view
    assert not out.parts_dir.exists()
    table = pq.read_table(path)
    assert keys_of(table) == ["a.q0", "a.q1", "b.q0", "b.q1"]  # sorted by doc, question
    meta = read_metadata(path)
    assert meta["schema_version"] == SCHEMA_VERSION
    assert meta["job_spec"] == json.loads(SPEC)
    assert meta["versions"] == VERSIONS
    assert meta["created_at"] and meta["updated_at"]
    assert table.schema.metadata[b"salabatch.job_spec"] == SPEC.encode()
    assert set(current_versions()) >= {"salabatch", "mlx", "python"}


def test_one_row_per_key_ok_beats_error_then_latest_wins(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0", answer="first"), make_row("a.q1", status="error")])
        out.write([make_row("a.q0", status="error"), make_row("a.q1", answer="fixed")])
        out.write([make_row("a.q0", answer="second")])
    table = read_results(path)
    assert keys_of(table) == ["a.q0", "a.q1"]
    assert table.column("answer").to_pylist() == ["second", "fixed"]


def test_closes_on_keyboard_interrupt(tmp_path):
    path = tmp_path / "r.parquet"
    with pytest.raises(KeyboardInterrupt), writer(path) as out:
        out.write([make_row("a.q0")])
        raise KeyboardInterrupt
    assert keys_of(pq.read_table(path)) == ["a.q0"]
    assert not out.parts_dir.exists()
    with pytest.raises(ValueError, match="closed"):
        out.write([make_row("a.q1")])


def test_one_writer_per_file(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path), pytest.raises(OutputError, match="another salabatch run"):
        writer(path)
    with writer(path):  # released on close
        pass


def test_one_writer_per_file_through_a_link_too_and_the_link_stays(tmp_path):
    """A run through a link to the results took its own lock (the link's .parts): both runs
    did the whole job, and the merge replaced the link with a file of its own."""
    path = tmp_path / "r.parquet"
    link = tmp_path / "link.parquet"
    link.symlink_to(path)
    with writer(path), pytest.raises(OutputError, match="another salabatch run"):
        writer(link)
    with writer(link) as out:
        out.write([make_row("a.q0")])
    assert link.is_symlink() and keys_of(read_results(path)) == ["a.q0"]
    assert keys_of(read_results(link)) == ["a.q0"]


# --- resume ----------------------------------------------------------------------------------


def test_resume_skips_done_rows_and_adds_new_ones(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        assert out.done_keys() == frozenset()
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
    with writer(path) as out:
        assert out.done_keys() == {"a.q0", "a.q1"}
        out.write([make_row("b.q0", run_id="run-2")])
        assert out.done_keys() == {"a.q0", "a.q1", "b.q0"}
    table = read_results(path)
    assert keys_of(table) == ["a.q0", "a.q1", "b.q0"]
    assert table.column("run_id").to_pylist() == ["run-1", "run-1", "run-2"]


def test_retry_errors_redoes_error_rows(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0"), make_row("a.q1", status="error")])
    with writer(path, retry_errors=True) as out:
        assert out.done_keys() == {"a.q0"}
        out.write([make_row("a.q1", answer="now it works")])
    assert read_results(path).column("status").to_pylist() == ["ok", "ok"]


def test_limited_retry_runs_name_themselves_until_one_sees_the_whole_job(tmp_path):
    """The file names the `--retry-errors --limit` runs of a series, whose error rows the next
    such run counts as done; a run without retry_errors keeps the series, a retry run that
    sees the whole job (retain) or has no limit ends it."""
    path = tmp_path / "r.parquet"
    errors = [f"a.q{i}" for i in range(4)]
    with writer(path) as out:
        out.write([make_row(key, status="error", run_id="first") for key in errors])
    with writer(path, retry_errors=True, limited=True) as out:
        assert out.done_keys() == set()
        out.write([make_row("a.q0", status="error", run_id="r1")])  # cut: no retain
    assert read_metadata(path)["retried_by"] == {"r1"}
    with writer(path, retry_errors=True, limited=True) as out:
        assert out.done_keys() == {"a.q0"}
        out.write([make_row("a.q1", status="error", run_id="r2")])
    with writer(path) as out:  # a run that does not retry keeps the series
        assert out.done_keys() == set(errors)
        out.write([make_row("b.q0", run_id="plain")])
    assert read_metadata(path)["retried_by"] == {"r1", "r2"}
    with writer(path, retry_errors=True) as out:  # no limit: every error row, and the end
        assert out.done_keys() == {"b.q0"}
    assert read_metadata(path)["retried_by"] == frozenset()
    with writer(path, retry_errors=True, limited=True) as out:
        out.write([make_row("a.q2", status="error", run_id="r3")])
    with writer(path, retry_errors=True, limited=True) as out:
        assert out.done_keys() == {"a.q2", "b.q0"}
        out.retain([*errors, "b.q0"])  # it saw the whole job, with nothing to do: the end
    assert read_metadata(path)["retried_by"] == frozenset()


def test_no_resume_replaces_the_results_when_it_closes(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("old.q0"), make_row("old.q1")])
    before = path.read_bytes()
    with writer(path, resume=False) as out:
        assert out.done_keys() == frozenset()
        out.write([make_row("new.q0")])
        assert path.read_bytes() == before  # the old results stay until the new run ends
        assert keys_of(read_results(path)) == ["new.q0"]  # but readers see the new run
    assert keys_of(pq.read_table(path)) == ["new.q0"]


def test_a_run_without_rows_changes_nothing(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path):
        pass
    assert not path.exists() and not (tmp_path / "r.parquet.parts").exists()
    with writer(path) as out:
        out.write([make_row("old.q0")])
    before = path.read_bytes()
    with pytest.raises(RuntimeError), writer(path, resume=False):
        raise RuntimeError("the model failed to load")
    assert path.read_bytes() == before
    assert keys_of(read_results(path)) == ["old.q0"]


def test_retain_drops_stale_rows_of_earlier_runs(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.write([make_row("a.q0"), make_row("a.q1"), make_row("gone.q0")])
    with writer(path) as out:
        out.retain(["a.q0", "a.q1", "b.q0"])
        out.write([make_row("b.q0"), make_row("extra.q0")])  # written now: always kept
    assert keys_of(read_results(path)) == ["a.q0", "a.q1", "b.q0", "extra.q0"]


def test_retain_with_nothing_new_or_stale_leaves_the_file_alone(tmp_path):
    path = tmp_path / "r.parquet"
    with writer(path) as out:
        out.retain([])
    assert not path.exists() and not out.parts_dir.exists()  # no empty file
    with writer(path) as out:
        out.write([make_row("a.q0")])
    before = path.read_bytes()
    with writer(path) as out:
        out.retain(["a.q0", "b.q0"])
    assert path.read_bytes() == before


# --- SIGKILL at any moment --------------------------------------------------------------------

# Writes N_BATCHES batches of two rows ("<b>.q0", "<b>.q1") and kills itself with SIGKILL at the
# moment named by argv[3], by wrapping os.replace / os.unlink as the writer calls them.
KILLED_RUN = r"""
import os, signal, sys
from datetime import datetime, timezone
from salabatch.jobs.results import writer as result_writer
from salabatch.jobs.results.schema import ResultRow

path, resume, moment = sys.argv[1], sys.argv[2] == "resume", sys.argv[3]
n_batches, kill_after = int(sys.argv[4]), int(sys.argv[5])
real_replace, real_unlink = os.replace, os.unlink
renamed_parts, unlinked_parts = [0], [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def replace(src, dst):
    if str(dst) == path and moment == "merge-before-rename":
        die()
    if ".parts" in str(dst) and moment == "temp-part" and renamed_parts[0] == kill_after:
        die()  # a part written and fsync'd, never renamed: left as a temp file
    real_replace(src, dst)
    renamed_parts[0] += ".parts" in str(dst)
    if str(dst) == path and moment == "merge-after-rename":
        die()

def unlink(p, *a, **k):
    if "part-" in str(p) and moment == "merge-mid-delete" and unlinked_parts[0] == 1:
        die()
    real_unlink(p, *a, **k)
    unlinked_parts[0] += "part-" in str(p)

result_writer.os.replace, result_writer.os.unlink = replace, unlink

def row(key):
    doc, q = key.split(".")
    return ResultRow(
        run_id="killed", job_name="contracts", doc_id=doc, doc_path="/d", doc_sha256="",
        question_id=q, question="?", request_key=key, model="m", answer="a " + key,
        finished_at=datetime.now(timezone.utc),
    )

out = result_writer.ResultWriter(path, job_spec_json="{}", versions={}, resume=resume)
for b in range(n_batches):
    if moment == "between-parts" and b == kill_after:
        die()
    out.write([row(f"{b:02d}.q0"), row(f"{b:02d}.q1")])
out.close()
print("closed without being killed", file=sys.stderr)
sys.exit(3)
"""
N_BATCHES, KILL_AFTER = 5, 3


def run_killed(path: Path, *, resume: bool, moment: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [str(path), "resume" if resume else "fresh", moment, str(N_BATCHES), str(KILL_AFTER)]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def batch_keys(batches: range) -> set[str]:
    return {f"{b:02d}.q{q}" for b in batches for q in (0, 1)}


@pytest.mark.parametrize(
    "moment, finished, resume",
    [
        ("between-parts", range(KILL_AFTER), True),
        ("temp-part", range(KILL_AFTER), True),
        ("merge-before-rename", range(N_BATCHES), True),
        ("merge-after-rename", range(N_BATCHES), True),
        ("merge-mid-delete", range(N_BATCHES), True),
        # --no-resume: the old rows must not come back, the killed run's rows must not go
        ("between-parts", range(KILL_AFTER), False),
        ("merge-after-rename", range(N_BATCHES), False),
        ("merge-mid-delete", range(N_BATCHES), False),
    ],
)
def test_sigkill_loses_no_finished_row_and_resume_completes(tmp_path, resume, moment, finished):
    path = tmp_path / "r.parquet"
    old = {"old.q0", "old.q1"}
    with writer(path) as out:
        out.write([make_row(k) for k in sorted(old)])

    run_killed(path, resume=resume, moment=moment)

    assert keys_of(pq.read_table(path))  # the file on disk is readable at every moment
    expected = batch_keys(finished) | (old if resume else set())
    assert sorted(keys_of(read_results(path))) == sorted(expected)
    with writer(path) as out:  # the rerun resumes (also after --no-resume)
        assert out.done_keys() == expected
        todo = sorted(batch_keys(range(N_BATCHES)) - out.done_keys())
        out.write([make_row(k, run_id="rerun") for k in todo])
    keys = keys_of(pq.read_table(path))
    assert sorted(keys) == sorted(batch_keys(range(N_BATCHES)) | (old if resume else set()))
    assert len(keys) == len(set(keys))
    assert not (tmp_path / "r.parquet.parts").exists()  # temp files and parts cleaned up


def test_a_lock_taken_on_the_lock_file_an_ending_writer_removed_is_taken_again(
    tmp_path, monkeypatch
):
    # A writer ending idle removes LOCK and the parts folder while it holds the lock; a run that
    # opened that LOCK just before gets its flock once it is released, on a file no longer there:
    # a third run would then lock a new LOCK, and two writers hold one results file.
    from salabatch.jobs.results import writer as module

    path = tmp_path / "r.parquet"
    opened = []
    real_open = os.open

    def open_then_the_other_ends(name, *args):
        fd = real_open(name, *args)
        if str(name).endswith("LOCK") and not opened:  # the other writer ends just now
            os.unlink(name)
            os.rmdir(os.path.dirname(name))
        opened.append(fd)
        return fd

    monkeypatch.setattr(module.os, "open", open_then_the_other_ends)
    with writer(path) as out:
        lock = out.parts_dir / "LOCK"
        assert len(opened) == 2  # the removed file, then the one there now
        assert os.path.samestat(os.fstat(out._lock_fd), os.stat(lock))
        with pytest.raises(OutputError, match="another salabatch run is writing"):
            writer(path).__enter__()
