"""salabatch.files: the one cache folder and the atomic, durable write everything uses."""

from __future__ import annotations

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
    from salabatch.jobs.spec import CacheSettings

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
