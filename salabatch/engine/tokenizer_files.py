"""The Hugging Face tokenizer files of a checkpoint: read, validate, fingerprint.

`load_tokenizer` (`salabatch.engine.tokenizer`) decides what the files mean (which BOS, which
stop tokens); this module knows their formats: where HF writes what, and the ways it varies.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from salabatch.errors import TokenizerError

TOKENIZER_FILE = "tokenizer.json"
# Files whose bytes go into the fingerprint as they are; config.json/generation_config.json
# contribute only their token fields (they also hold sampling and model settings).
_FINGERPRINT_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id")


def read_backend(model_dir: Path) -> _Backend:
    """The HF `tokenizers.Tokenizer` of `model_dir/tokenizer.json`."""
    tok_path = model_dir / TOKENIZER_FILE
    if not tok_path.is_file():
        hint = ""
        if (model_dir / "tokenizer.model").is_file():
            hint = (
                "; only a SentencePiece tokenizer.model is there: convert it once with "
                "transformers, `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`"
            )
        raise TokenizerError(f"missing {TOKENIZER_FILE}{hint}", path=model_dir)
    try:
        return _Backend.from_str(tok_path.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side raises a bare Exception
        raise TokenizerError(f"cannot parse: {e}", path=tok_path) from e


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file is absent (every config file is optional)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read JSON: {e}", path=path) from e
    if not isinstance(data, dict):
        raise TokenizerError("expected a JSON object", path=path, got=type(data).__name__)
    return data


def id_list(cfg: dict, key: str, path: Path, vocab_size: int) -> list[int]:
    """`cfg[key]` as a list of token ids (HF allows an int or a list); [] when absent."""
    value = cfg.get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise TokenizerError(
                "bad token id", path=path, field=key, expected=f"ints in [0, {vocab_size})", got=v
            )
    return list(values)


def reconcile_added_tokens(backend: _Backend, tok_cfg: dict, added: dict, model_dir: Path) -> None:
    """Check tokenizer_config's `added_tokens_decoder` and added_tokens.json against the backend.

    A listed token the backend lacks is added when its id is the next free one; any other
    disagreement is an error (a silently shifted special id would corrupt every prompt).
    """
    wanted: dict[int, tuple[str, bool]] = {}
    for tid, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        if not str(tid).isdigit() or not isinstance(entry, dict):
            raise TokenizerError(
                "bad entry",
                path=model_dir / "tokenizer_config.json",
                field=f"added_tokens_decoder.{tid}",
                expected="an id string mapped to {'content': ...}",
            )
        if isinstance(entry.get("content"), str):
            wanted[int(tid)] = (entry["content"], bool(entry.get("special", True)))
    for content, tid in added.items():
        if isinstance(tid, int) and tid not in wanted:
            wanted[tid] = (content, True)
    for tid in sorted(wanted):
        content, special = wanted[tid]
        have = backend.token_to_id(content)
        if have == tid:
            continue
        if have is None and tid == backend.get_vocab_size(with_added_tokens=True):
            token = AddedToken(content, special=special, normalized=False)
            (backend.add_special_tokens if special else backend.add_tokens)([token])
            continue
        raise TokenizerError(
            f"added token {content!r} disagrees with {TOKENIZER_FILE}",
            path=model_dir / "tokenizer_config.json",
            expected=f"id {tid}",
            got=have,
        )


def read_chat_template(model_dir: Path, tok_cfg: dict) -> tuple[str | None, Path | None]:
    """(template source, the file it came from), or (None, None) when there is none."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():  # transformers >= 4.43 saves the template here; it takes precedence
        return jinja_path.read_text(encoding="utf-8"), jinja_path
    if tok_cfg.get("chat_template") is None:
        return None, None
    path = model_dir / "tokenizer_config.json"
    return _pick_template(tok_cfg["chat_template"], path), path


def _pick_template(value: Any, path: Path) -> str:
    """tokenizer_config `chat_template`: a string, or HF's list of {name, template}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(
        "unusable chat_template",
        path=path,
        field="chat_template",
        expected="a string or a list with a 'default' entry",
        got=type(value).__name__,
    )


def tokenizer_fingerprint(model_dir: Path, cfgs: dict[str, dict]) -> str:
    """sha256 over tokenizer.json, the tokenizer-side files, and the token fields of the configs."""
    h = hashlib.sha256()
    for name in (TOKENIZER_FILE, *_FINGERPRINT_FILES):
        path = model_dir / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(f"{name}:{len(data)}:".encode())
        h.update(data)
    for name, cfg in sorted(cfgs.items()):
        fields = {k: cfg.get(k) for k in _TOKEN_FIELDS}
        h.update(f"{name}:{json.dumps(fields, sort_keys=True)}".encode())
    return h.hexdigest()


def parse_backend(source: str, *, plain: bool) -> _Backend:
    """A backend from tokenizer.json text; `plain` encodes special-token text as characters."""
    backend = _Backend.from_str(source)
    backend.encode_special_tokens = plain
    return backend


def continuation_source(source: str) -> str | None:
    """tokenizer.json text for encoding text that continues a prompt; None if `source` will do.

    That is `source` without the word-start marker (see `_without_prefix_marker`).
    """
    cfg = json.loads(source)
    return json.dumps(cfg) if _without_prefix_marker(cfg) else None


def _without_prefix_marker(node: Any) -> bool:
    """Turn off the word-start marker a backend adds at the start of every text it encodes.

    Legacy Llama/SentencePiece conversions prepend "▁" (normalizer `Prepend`, or `Metaspace`
    with a prepend scheme); byte-level ones may add a space (`add_prefix_space`). A piece of text
    that continues a prompt must not get one. Edits the parsed tokenizer.json in place; returns
    whether anything changed.
    """
    changed = False
    for key in ("normalizer", "pre_tokenizer"):
        part = node.get(key)
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "Prepend":
            node[key] = None
            changed = True
        elif kind == "Sequence":
            inner_key = "normalizers" if key == "normalizer" else "pretokenizers"
            inner = part.get(inner_key) or []
            kept = [p for p in inner if p.get("type") != "Prepend"]
            changed |= len(kept) != len(inner)
            part[inner_key] = kept
            for p in kept:
                changed |= _edit_prefix_flags(p)
        else:
            changed |= _edit_prefix_flags(part)
    return changed


def _edit_prefix_flags(part: dict) -> bool:
    """Clear a Metaspace prepend scheme and `add_prefix_space`; return whether either was set."""
    changed = False
    if part.get("type") == "Metaspace" and part.get("prepend_scheme", "never") != "never":
        part["prepend_scheme"] = "never"
        changed = True
    if part.get("add_prefix_space"):
        part["add_prefix_space"] = False
        changed = True
    return changed
