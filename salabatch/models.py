"""A model reference → a checkpoint folder on disk. The one place that tells the kinds apart;
the engine takes the folder (`salabatch.engine.load_model(folder)`) and knows none of them.

A reference is one of:

* `builtin:NAME`: one of salabatch's own models (`salabatch.demo.builtin`): `builtin:tiny` is
  shipped in the package, `builtin:random` is made locally on first use;
* a checkpoint folder: any path that exists, and any reference starting with `/`, `.` or `~`;
* a Hugging Face Hub repo id, `org/name` or `org/name@revision` (a branch, tag or commit), when
  no such path exists: its checkpoint files (config, safetensors, tokenizer and chat template,
  generation config; not the `*.bin` or subfolders) are found in the HF cache or downloaded
  into it by `huggingface_hub.snapshot_download`.

An existing path always wins, so a folder `org/name` beside you shadows the repo (a job file's
relative paths are taken from the job's folder, see `salabatch.jobs.spec`). A path that does not
exist and is not shaped like a repo id (`./x`, `~/x`, `a/b/c`, `name`) stays a path, and its
absence is reported as such.

The Hub is read as `huggingface_hub` reads it: `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE`)
uses the cache only; the cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`. Both are read at each call, not when huggingface_hub is imported.
Every failure is one CheckpointError line that says what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from salabatch.demo import builtin
from salabatch.errors import CheckpointError, ConfigError

BUILTIN = "builtin:"
# Hub repo names: letters, digits, - _ . ; neither "--" nor ".." (huggingface_hub's rules).
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9][\w./-]*))?", re.A)
# What a checkpoint needs; the tokenizer's files are added from `TOKENIZER_FILES`.
_CHECKPOINT_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubRepo:
    """A Hub model repo id and the revision to take (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def is_builtin(ref: str | os.PathLike) -> bool:
    """Whether `ref` names a builtin model (`builtin:NAME`) rather than a folder or a repo."""
    return str(ref).startswith(BUILTIN)


def builtin_name(ref: str | os.PathLike) -> str | None:
    """NAME of a `builtin:NAME` reference, None for any other; ConfigError if NAME is unknown."""
    if not is_builtin(ref):
        return None
    name = str(ref).removeprefix(BUILTIN)
    if name not in builtin.MODELS:
        known = ", ".join(BUILTIN + m for m in builtin.MODELS)
        raise ConfigError(f"unknown builtin model {str(ref)!r} (available: {known})")
    return name


def model_note(ref: str | os.PathLike) -> str | None:
    """What a user should know about the model `ref` names (a builtin one), else None."""
    name = builtin_name(ref)
    return None if name is None else builtin.NOTES[name]


def hub_repo(ref: str | os.PathLike) -> HubRepo | None:
    """The repo `ref` names if it is shaped like `org/name[@revision]`, else None (a path or
    a builtin). Looks at the text only: `resolve_model` lets an existing path win."""
    match = _REPO_ID.fullmatch(str(ref))
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return HubRepo(match["repo"], match["revision"])


def resolve_model(ref: str | os.PathLike, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder of `ref` (see the module docstring); `cache_dir` holds builtin
    models (default: the salabatch cache). A Hub repo goes to the HF cache, downloaded if it
    is not there; a `Path` is always a path."""
    name = builtin_name(ref)
    if name is not None:
        return builtin.checkpoint(name, cache_dir)
    path = Path(ref).expanduser()
    repo = hub_repo(ref) if isinstance(ref, str) else None
    if repo is None or path.exists():
        return path
    return resolve_hub(repo)


def hf_hub_cache() -> Path:
    """The Hugging Face cache folder that the environment names now."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        folder = env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]
    elif env.get("HF_HOME"):
        folder = os.path.join(env["HF_HOME"], "hub")
    else:
        root = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        folder = os.path.join(root, "huggingface", "hub")
    return Path(os.path.expandvars(folder)).expanduser()


def hf_offline() -> bool:
    """Whether the environment forbids reaching the Hub now (`HF_HUB_OFFLINE=1`)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def resolve_hub(repo: HubRepo) -> Path:
    """The snapshot folder of `repo` in the HF cache, downloaded there first unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from salabatch.engine.tokenizer_files import TOKENIZER_FILES

    cache, offline = hf_hub_cache(), hf_offline()
    fetch = f"download it with `hf download {repo.repo_id}`" + (
        f" --revision {repo.revision}" if repo.revision else ""
    )
    try:
        folder = snapshot_download(
            repo.repo_id,
            revision=repo.revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=[*_CHECKPOINT_FILES, *TOKENIZER_FILES],
            ignore_patterns=["*/*"],  # subfolders hold other formats, never this checkpoint
        )
    except IncompleteSnapshotError:
        why = f"is only partly in the Hugging Face cache {cache} and the Hub cannot be reached"
        raise _hub_error(repo, f"{why}: {fetch} when online") from None
    except LocalEntryNotFoundError as e:
        if offline:
            why = f"is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set"
            raise _hub_error(repo, f"{why}: {fetch}, or unset HF_HUB_OFFLINE") from None
        cause = e.__cause__ or e
        why = f"cannot reach the Hugging Face Hub ({_one_line(cause)}) and {cache} lacks it"
        raise _hub_error(repo, f"{why}: check the network, or {fetch} elsewhere") from None
    except GatedRepoError:
        why = "is gated on the Hugging Face Hub: accept its terms on its page"
        raise _hub_error(repo, f"{why}, then log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        why = "no such model repo on the Hugging Face Hub (or it is private"
        raise _hub_error(repo, f"{why}: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise _hub_error(repo, f"no revision {repo.revision!r} in this Hub repo") from None
    except (HfHubHTTPError, OSError) as e:
        raise _hub_error(repo, f"cannot download it ({_one_line(e)})") from None
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        why = f"the Hub repo has no config.json or no *.safetensors (found in {folder})"
        raise _hub_error(repo, f"{why}; salabatch reads safetensors checkpoints")
    return folder


def _hub_error(repo: HubRepo, message: str) -> CheckpointError:
    return CheckpointError(f"model {repo}: {message}")


def _one_line(e: BaseException) -> str:
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or type(e).__name__
