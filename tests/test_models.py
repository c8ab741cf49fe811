"""Model references: builtin, folder, Hugging Face repo id. The Hub is never called: repos come
from a fake offline HF cache (the layout huggingface_hub writes), and the failures from local
servers that refuse or answer 404."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import huggingface_hub.constants
import pytest
import yaml
from click.testing import CliRunner

from salabatch.cli import main
from salabatch.errors import CheckpointError, JobValidationError
from salabatch.jobs.results.read import read_results
from salabatch.jobs.run.prepare import JobSetup
from salabatch.jobs.spec.load import check_paths, load_job
from salabatch.models import HubRepo, hf_hub_cache, hub_repo, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny"


def git_blob_sha1(data: bytes) -> str:
    """The id git (and the Hub, for a non-LFS file) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hub_cache(hub: Path, repo_id: str, src: Path, commit: str = COMMIT) -> Path:
    """Puts the files of `src` into the HF cache `hub` as huggingface_hub lays a download out:
    `models--org--name/blobs/<etag>` (sha256 for LFS files, git sha1 for the rest), linked from
    `snapshots/<commit>/<name>`, and `refs/main` naming the commit. Returns the snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(src.iterdir()):
        data = file.read_bytes()
        lfs = file.suffix == ".safetensors"
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        (repo / "blobs" / etag).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", etag))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    """builtin:random's files (an untrained test model with a tokenizer and chat template)."""
    return resolve_model("builtin:random", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory, tiny_src) -> Path:
    hub = tmp_path_factory.mktemp("hf") / "hub"
    write_hub_cache(hub, REPO, tiny_src)
    return hub


@pytest.fixture
def offline(hub_dir, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 with the fake cache as HF_HUB_CACHE; the snapshot folder."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_dir / "models--org--tiny" / "snapshots" / COMMIT


@pytest.fixture
def online(tmp_path, monkeypatch) -> Path:
    """Hub calls allowed, into an empty cache; the endpoint is set by each test (local only)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    return tmp_path / "empty-hub"


# ---- what is a repo id ----------------------------------------------------------------------


def test_repo_ids_are_org_slash_name_with_an_optional_revision():
    assert hub_repo("openbmb/MiniCPM-SALA") == HubRepo("openbmb/MiniCPM-SALA")
    assert hub_repo("mlx-community/Qwen2.5-7B@v1.0") == HubRepo("mlx-community/Qwen2.5-7B", "v1.0")
    assert hub_repo(f"org/tiny@{COMMIT}") == HubRepo("org/tiny", COMMIT)
    assert str(HubRepo("org/tiny", "refs/pr/1")) == "org/tiny@refs/pr/1"
    for path in ("./org/name", "/org/name", "~/name", "../org/name", "name", "a/b/c", "org/",
                 "org/na--me", "org/na..me", "org/name@", "org/.hidden", "builtin:random",
                 "org name/x", "org/name/"):  # fmt: skip
        assert hub_repo(path) is None, path


def test_an_existing_folder_wins_over_a_repo_id(tmp_path, monkeypatch, offline):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    assert resolve_model("org/tiny") == Path("org/tiny")
    assert resolve_model(Path("org/other")) == Path("org/other")  # a Path is always a path
    assert resolve_model("a/b/c") == Path("a/b/c")  # not a repo id: the loader says it is missing


def test_the_hf_cache_follows_the_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_hub_cache() == tmp_path / "hub"


# ---- resolving from the cache, and the failures ----------------------------------------------


def test_a_cached_repo_resolves_offline_to_its_snapshot(offline):
    assert resolve_model(REPO) == offline
    assert resolve_model(f"{REPO}@main") == offline
    assert resolve_model(f"{REPO}@{COMMIT}") == offline
    assert (offline / "model.safetensors").is_symlink()


def one_line_error(ref: str) -> str:
    with pytest.raises(CheckpointError) as e:
        resolve_model(ref)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"model {ref}: ")
    return text


def test_a_repo_missing_offline_says_how_to_get_it(offline):
    text = one_line_error("org/missing")
    assert "not in the Hugging Face cache" in text and "HF_HUB_OFFLINE is set" in text
    assert "`hf download org/missing`" in text and str(offline.parents[2]) in text
    assert "--revision v2" in one_line_error(f"{REPO}@v2")  # no such ref cached


def test_a_partly_cached_repo_is_refused_offline(tmp_path, monkeypatch, tiny_src):
    hub = tmp_path / "hub"
    snapshot = write_hub_cache(hub, REPO, tiny_src)
    (snapshot / "model.safetensors").unlink()  # an interrupted download
    trees = snapshot.parents[1] / "trees"
    trees.mkdir()
    listing = {f.name: {"size": f.stat().st_size, "blob_id": "0" * 40} for f in tiny_src.iterdir()}
    (trees / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": listing}))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "only partly in the Hugging Face cache" in one_line_error(REPO)


def test_a_repo_without_safetensors_is_refused(tmp_path, monkeypatch, tiny_src):
    src = tmp_path / "bin-only"
    shutil.copytree(tiny_src, src)
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    write_hub_cache(tmp_path / "hub", REPO, src)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "no config.json or no *.safetensors" in one_line_error(REPO)


def test_an_unreachable_hub_is_one_line(online, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    text = one_line_error("org/anything")
    assert "cannot reach the Hugging Face Hub" in text and "check the network" in text


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers one for a repo that does not exist."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_repo_the_hub_does_not_have_is_one_line(online, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        text = one_line_error("org/nothing")
    finally:
        server.shutdown()
        server.server_close()
    assert "no such model repo on the Hugging Face Hub" in text and "hf auth login" in text


# ---- the commands on a repo id ---------------------------------------------------------------


def test_generate_runs_a_cached_repo(offline):
    result = CliRunner().invoke(main, ["generate", REPO, "hi", "--max-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert "first token after" in result.output


def test_generate_on_a_missing_repo_is_one_error_line(offline):
    result = CliRunner().invoke(main, ["generate", "org/missing", "hi"])
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and "HF_HUB_OFFLINE" in result.output


def write_job(folder: Path, model: str, output: str) -> Path:
    docs = folder / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "report.md").write_text("# Report\n\n" + "The quay needs new fenders. " * 40)
    job = {
        "name": "hub",
        "model": model,
        "documents": [{"path": "docs"}],
        "questions": [{"id": "q", "text": "What is needed?"}],
        "generation": {"max_tokens": 3},
        "engine": {"prefill_chunk": 128, "pool_max_tokens": 32},  # the document: one prefix
        "cache": {"dir": str(folder / "cache")},
        "output": {"path": output},
    }
    path = folder / f"{Path(output).stem}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_a_job_names_a_repo_id_or_a_folder(tmp_path, offline):
    job = write_job(tmp_path, REPO, "a.parquet")
    spec = load_job(job, check_files=True)
    assert spec.model == REPO and check_paths(spec) == []
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a folder beside the job wins
    assert load_job(job).model == str(tmp_path / "org" / "tiny")
    problems = check_paths(load_job(write_job(tmp_path, "./org/none", "b.parquet")))
    assert problems == [f"model: no such folder: {tmp_path / 'org' / 'none'}"]
    with pytest.raises(JobValidationError, match="model: no such folder"):
        load_job(write_job(tmp_path, "a/b/c", "c.parquet"), check_files=True)


def test_a_job_on_a_repo_id_runs_and_shares_its_caches_with_the_same_folder(tmp_path, offline):
    job = write_job(tmp_path, REPO, "hub.parquet")
    dry = CliRunner().invoke(main, ["run", str(job), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert REPO in dry.output
    run = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert run.exit_code == 0, run.output
    (hub_row,) = read_results(tmp_path / "hub.parquet").to_pylist()
    assert hub_row["status"] == "ok" and hub_row["model"] == REPO
    assert hub_row["cache_source"] == "none"

    folder = Path(shutil.copytree(offline, tmp_path / "plain", symlinks=False))
    assert not (folder / "model.safetensors").is_symlink()
    job = write_job(tmp_path, str(folder), "plain.parquet")
    plain, hub = JobSetup.of(load_job(job)), JobSetup.of(load_job(tmp_path / "hub.yaml"))
    assert plain.model_sha == hub.model_sha and plain.tok.fingerprint == hub.tok.fingerprint
    run = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert run.exit_code == 0, run.output
    (plain_row,) = read_results(tmp_path / "plain.parquet").to_pylist()
    # the same prefix key: the folder's run reuses the prefix the repo's run stored
    assert plain_row["model_sha"] == hub_row["model_sha"]
    assert plain_row["cache_source"] == "disk" and plain_row["answer"] == hub_row["answer"]
