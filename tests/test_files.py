"""salabatch.files: the one cache folder and the atomic, durable write everything uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from salabatch import files


def test_cache_dir_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert files.cache_dir() == tmp_path / "xdg" / "salabatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert files.cache_dir() == tmp_path / "home" / ".cache" / "salabatch"


def test_a_job_and_the_cache_commands_use_the_same_store(monkeypatch, tmp_path):
    from salabatch.jobs.spec.models import CacheSettings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert CacheSettings().dir == files.cache_dir() == tmp_path / "xdg" / "salabatch"


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    dst = tmp_path / "a.json"
    dst.write_text("old")
    files.write_text_atomic(dst, "new")
    assert dst.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    dst = tmp_path / "data.safetensors"
    dst.write_text("old")
    seen: list[Path] = []

    def write(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        files.write_atomic(dst, write)
    assert dst.read_text() == "old"
    assert seen[0].suffix == ".safetensors" and files.is_temp(seen[0])
    assert not seen[0].exists()


def test_temporaries_go_where_they_are_told(tmp_path):
    parts = tmp_path / "x.parquet.parts"
    parts.mkdir()
    tmp = files.temp_path(tmp_path / "x.parquet", parts)
    assert tmp.parent == parts and files.is_temp(tmp) and tmp.name.endswith(".parquet")
    assert not files.is_temp(tmp_path / "part-000001-abc.parquet")


def test_a_temporary_names_its_writer_and_a_dead_writer_is_not_alive(tmp_path):
    for dst in (tmp_path / "a.b.safetensors", tmp_path / "builtin-tiny-v2", tmp_path / ".x.json"):
        assert files.temp_pid(files.temp_path(dst)) == os.getpid()
    assert files.temp_pid(tmp_path / "a.safetensors") is None
    assert files.temp_pid(tmp_path / ".a.tmp-12-notahex.json") is None
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    assert files.pid_alive(os.getpid()) and not files.pid_alive(child.pid)
    assert files.pid_alive(1)  # init: alive, whoever owns it
    assert not files.pid_alive(0) and not files.pid_alive(2**40)


def test_a_write_removes_the_temporaries_of_its_file_a_killed_writer_left(tmp_path):
    """A run killed while it wrote its OpenAI Batch output left `.x.tmp-PID-hex.jsonl` beside
    it for good, one more each time; the next write of x.jsonl removes those of dead writers,
    not a live writer's, nor another file's."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    dead = tmp_path / f".x.tmp-{child.pid}-0123abcd.jsonl"
    live = tmp_path / f".x.tmp-{os.getpid()}-0123abcd.jsonl"
    other = tmp_path / f".x.tmp-{child.pid}-0123abcd.parquet"
    for path in (dead, live, other):
        path.write_text("half")
    files.write_text_atomic(tmp_path / "x.jsonl", "{}\n")
    assert not dead.exists() and live.exists() and other.exists()
    assert (tmp_path / "x.jsonl").read_text() == "{}\n"


def test_disk_bytes_and_remove_path_take_files_and_folders(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(bytes(300))
    (tmp_path / "d" / "g").write_bytes(bytes(200))
    assert files.disk_bytes(tmp_path / "d") == 500 and files.disk_bytes(tmp_path / "d" / "g") == 200
    assert files.disk_bytes(tmp_path / "missing") == 0
    assert files.remove_path(tmp_path / "d" / "g") and files.remove_path(tmp_path / "d")
    assert not (tmp_path / "d").exists() and files.remove_path(tmp_path / "missing")
