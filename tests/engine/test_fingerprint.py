"""Model fingerprints: over content, not paths; the Hugging Face cache's sha256 blob names are
reused without reading the weights, never a name that is not one; the memo of hashes saves
re-hashing, and a memo that cannot be written only warns."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from salabatch.engine import fingerprint
from salabatch.engine.fingerprint import hub_sha256, model_fingerprint
from salabatch.errors import CacheWarning
from tests.test_models import COMMIT, git_blob_sha1, write_hub_cache
from tests.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny checkpoint in several safetensors shards with an index."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), max_shard_bytes=200_000)
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """The files whose content the fingerprint reads, in order."""
    calls: list[Path] = []
    real = fingerprint.file_sha256

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(fingerprint, "file_sha256", counting)
    return calls


def test_the_fingerprint_follows_content_not_paths(sharded, tmp_path):
    copy = Path(shutil.copytree(sharded, tmp_path / "copy"))
    assert model_fingerprint(copy) == model_fingerprint(sharded)
    shard = sorted(copy.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    shard.write_bytes(bytes(data))
    assert model_fingerprint(copy) != model_fingerprint(sharded)


def test_weights_in_the_hf_cache_are_not_read(sharded, tmp_path, hashed):
    plain = model_fingerprint(sharded)
    assert len(hashed) == len(list(sharded.glob("*.safetensors")))
    hashed.clear()
    snapshot = write_hub_cache(tmp_path / "hub", "org/sharded", sharded)
    assert model_fingerprint(snapshot) == plain
    assert hashed == []


def test_only_a_sha256_blob_of_the_hf_layout_is_trusted(sharded, tmp_path, hashed):
    snapshot = write_hub_cache(tmp_path / "hub", "org/sharded", sharded)
    shard = sorted(snapshot.glob("*.safetensors"))[0]
    assert hub_sha256(shard) == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert hub_sha256(snapshot / "config.json") is None  # a non-LFS blob: git's 40-hex sha1
    assert hub_sha256(sharded / shard.name) is None  # not a link
    # A blob named like a sha256 that is not the content's, linked from outside a snapshot:
    # hashed, so the wrong name cannot give a wrong identity.
    folder = Path(shutil.copytree(sharded, tmp_path / "linked"))
    blobs = tmp_path / "elsewhere" / "blobs"
    blobs.mkdir(parents=True)
    fake = blobs / ("f" * 64)
    shutil.copy(folder / shard.name, fake)
    (folder / shard.name).unlink()
    (folder / shard.name).symlink_to(fake)
    assert hub_sha256(folder / shard.name) is None
    hashed.clear()
    assert model_fingerprint(folder) == model_fingerprint(sharded)
    assert Path(folder / shard.name) in hashed


def test_a_hf_blob_named_by_git_sha1_is_hashed(tiny_dir, tmp_path, hashed):
    snapshot = write_hub_cache(tmp_path / "hub", "org/tiny", tiny_dir)
    blob = (snapshot / "model.safetensors").resolve()
    renamed = blob.with_name(git_blob_sha1(blob.read_bytes()))  # as if not stored by LFS
    blob.rename(renamed)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(Path("..", "..", "blobs", renamed.name))
    assert snapshot.name == COMMIT
    assert model_fingerprint(snapshot) == model_fingerprint(tiny_dir)
    assert [p.name for p in hashed] == ["model.safetensors", "model.safetensors"]


def test_the_memo_saves_hashing_until_a_file_changes(tiny_dir, tmp_path, hashed):
    model = Path(shutil.copytree(tiny_dir, tmp_path / "m"))
    memo = tmp_path / "cache" / "fingerprints.json"
    first = model_fingerprint(model, memo=memo)
    assert memo.is_file() and len(hashed) == 1
    assert model_fingerprint(model, memo=memo) == first and len(hashed) == 1
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: hashed again
    assert model_fingerprint(model, memo=memo) == first and len(hashed) == 2


def test_a_memo_that_cannot_be_written_warns_once_and_the_fingerprint_comes(
    tiny_dir, tmp_path, monkeypatch
):
    def read_only(path, text):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(fingerprint, "write_text_atomic", read_only)
    memo = tmp_path / "cache" / "fingerprints.json"
    with pytest.warns(CacheWarning) as caught:
        got = model_fingerprint(tiny_dir, memo=memo)
    assert got == model_fingerprint(tiny_dir)
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith(f"{memo}: ") and os.strerror(errno.EROFS) in text and "\n" not in text
    assert text.count(str(memo)) == 1  # error_text leaves the path out of the reason
    assert not memo.exists()
