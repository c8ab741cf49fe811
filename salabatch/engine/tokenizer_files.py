"""What a checkpoint's tokenizer files mean: `read_files(model_dir)` reads them all once.

`tokenizer.json` (HF `tokenizers`) plus the optional `tokenizer_config.json`,
`special_tokens_map.json`, `added_tokens.json`, `chat_template.jinja`, `generation_config.json`
and `config.json`. `read_files` decides what they say together (which BOS, which stop tokens,
the chat template, a fingerprint for cache keys); the readers below it know each file's format
(where HF writes what, and the ways it varies). `continuation_source` is the tokenizer.json
that encodes text continuing a prompt (no word-start marker).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from salabatch.engine.config import read_config_json
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
# Everything a checkpoint's tokenizer comes from (`convert` copies these into a new checkpoint).
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    *_FINGERPRINT_FILES,
    "generation_config.json",
    "tokenizer.model",
)
# The JSON files load_tokenizer reads, and those of them that give token ids, in precedence order.
_JSON_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
    "added_tokens.json",
)
_ID_CONFIGS = ("generation_config.json", "config.json")
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id")
# The special tokens transformers names (`special_tokens_map`); a chat template sees each one that
# is set as a variable of that name.
_NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


@dataclass(frozen=True)
class TokenizerFiles:
    """What `Tokenizer` is built from (see its attributes)."""

    backend: Backend
    bos_id: int | None
    eos_ids: frozenset[int]
    add_bos_token: bool
    named_tokens: dict[str, str]
    chat_template: str | None
    chat_template_path: Path | None
    fingerprint: str


def read_files(model_dir: Path) -> TokenizerFiles:
    """The tokenizer files of the checkpoint directory `model_dir`, read and reconciled."""
    if not model_dir.is_dir():
        raise TokenizerError("not a directory", path=model_dir)
    backend = _read_backend(model_dir)
    cfgs = {name: _read_json(model_dir / name) for name in _JSON_FILES}
    tok_cfg = cfgs["tokenizer_config.json"]
    _reconcile_added_tokens(backend, tok_cfg, cfgs["added_tokens.json"], model_dir)
    _check_fits_model(backend, cfgs["config.json"], model_dir)
    bos_id = _bos_id(backend, cfgs, model_dir)
    template, template_path = _read_chat_template(model_dir, tok_cfg)
    return TokenizerFiles(
        backend,
        bos_id=bos_id,
        eos_ids=_eos_ids(backend, cfgs, model_dir),
        add_bos_token=_adds_bos(backend, tok_cfg, bos_id),
        named_tokens=_named_tokens(cfgs),
        chat_template=template,
        chat_template_path=template_path,
        fingerprint=_fingerprint(model_dir, {name: cfgs[name] for name in _ID_CONFIGS}),
    )


def _check_fits_model(backend: Backend, model_cfg: dict, model_dir: Path) -> None:
    """Refuses a tokenizer with more tokens than the model beside it has embeddings: its ids
    past `vocab_size` would index past the embedding table. The one place this is checked, so
    loading a model with its tokenizer refuses what `salabatch validate` refuses."""
    model_vocab = model_cfg.get("vocab_size")
    if isinstance(model_vocab, bool) or not isinstance(model_vocab, int) or model_vocab <= 0:
        return  # no model here, or a vocab_size config.py refuses with the reason
    tokens = backend.get_vocab_size(with_added_tokens=True)
    if tokens > model_vocab:
        raise TokenizerError(
            f"the tokenizer has {tokens} tokens, more than vocab_size {model_vocab} in "
            "config.json (ids past it have no embedding)",
            path=model_dir,
        )


def _bos_id(backend: Backend, cfgs: dict[str, dict], model_dir: Path) -> int | None:
    """tokenizer_config's `bos_token`, else the first `bos_token_id` of the configs."""
    bos_id = _text_id(backend, cfgs, "bos_token", model_dir)
    if bos_id is not None:
        return bos_id
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    for name in _ID_CONFIGS:
        ids = _id_list(cfgs[name], "bos_token_id", model_dir / name, vocab_size)
        if ids:
            return ids[0]
    return None


def _eos_ids(backend: Backend, cfgs: dict[str, dict], model_dir: Path) -> frozenset[int]:
    """The union of the configs' `eos_token_id`s (HF generate stops on them), else the id of
    tokenizer_config's `eos_token`."""
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    eos: set[int] = set()
    for name in _ID_CONFIGS:
        eos.update(_id_list(cfgs[name], "eos_token_id", model_dir / name, vocab_size))
    if not eos and (eos_id := _text_id(backend, cfgs, "eos_token", model_dir)) is not None:
        eos.add(eos_id)
    if not eos:
        raise TokenizerError(
            "no stop token: expected eos_token_id in generation_config.json or config.json, "
            "or eos_token in tokenizer_config.json",
            path=model_dir,
        )
    return frozenset(eos)


def _adds_bos(backend: Backend, tok_cfg: dict, bos_id: int | None) -> bool:
    """tokenizer_config's `add_bos_token`, else what the backend's post-processor would do."""
    if "add_bos_token" in tok_cfg:
        return bool(tok_cfg["add_bos_token"])
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    return bos_id is not None and full[:1] == [bos_id] and plain[:1] != [bos_id]


def _named_tokens(cfgs: dict[str, dict]) -> dict[str, str]:
    """The special tokens a chat template sees by name, as transformers passes them: the
    standard names, tokenizer_config's other `*_token` entries and the names of a mapping
    `extra_special_tokens` (model-specific tokens such as `image_token`). A list of extra special
    tokens is not passed."""
    tok_cfg = cfgs["tokenizer_config.json"]
    extra = tok_cfg.get("extra_special_tokens")
    names = [*_NAMED_TOKENS, *(k for k in tok_cfg if k.endswith("_token"))]
    tokens = {name: text for name in names if (text := _token_text(cfgs, name)) is not None}
    if isinstance(extra, dict):
        tokens.update({k: text for k, v in extra.items() if (text := _content(v)) is not None})
    return tokens


def _token_text(cfgs: dict[str, dict], key: str) -> str | None:
    """The text of special token `key`; tokenizer_config wins over special_tokens_map."""
    found = _token_source(cfgs, key)
    return found[0] if found else None


def _token_source(cfgs: dict[str, dict], key: str) -> tuple[str, str] | None:
    """The text of special token `key` and the name of the file it came from."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (text := _content(cfgs[name].get(key))) is not None:
            return text, name
    return None


def _content(value: Any) -> str | None:
    """The text of a token entry: HF writes "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _text_id(backend: Backend, cfgs: dict[str, dict], key: str, model_dir: Path) -> int | None:
    """The id of special token `key` (see `_token_text`); None when no file names it."""
    found = _token_source(cfgs, key)
    if found is None:
        return None
    text, name = found
    tid = backend.token_to_id(text)
    if tid is None:
        raise TokenizerError(f"{key} {text!r} is not in the vocabulary", path=model_dir / name)
    return tid


def _read_backend(model_dir: Path) -> Backend:
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
        return Backend.from_str(tok_path.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side raises a bare Exception
        raise TokenizerError(f"cannot parse: {e}", path=tok_path) from e


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file is absent (every config file is optional).
    config.json is the model's config, read and refused as the model reads it."""
    if not path.is_file():
        return {}
    if path.name == "config.json":
        return read_config_json(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read JSON: {e}", path=path) from e
    if not isinstance(data, dict):
        raise TokenizerError("expected a JSON object", path=path, got=type(data).__name__)
    return data


def _id_list(cfg: dict, key: str, path: Path, vocab_size: int) -> list[int]:
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


def _reconcile_added_tokens(backend: Backend, tok_cfg: dict, added: dict, model_dir: Path) -> None:
    """Check tokenizer_config's `added_tokens_decoder` and added_tokens.json against the backend.

    A listed token the backend lacks is added when its id is the next free one; any other
    disagreement is an error (a silently shifted special id would corrupt every prompt).
    """
    wanted: dict[int, tuple[str, bool]] = {}
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(
            "bad value",
            path=model_dir / "tokenizer_config.json",
            field="added_tokens_decoder",
            expected="an object: id strings mapped to {'content': ...}",
            got=type(decoder).__name__,
        )
    for tid, entry in decoder.items():
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


def _read_chat_template(model_dir: Path, tok_cfg: dict) -> tuple[str | None, Path | None]:
    """(template source, the file it came from), or (None, None) when there is none."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():  # transformers >= 4.43 saves the template here; it takes precedence
        try:
            return jinja_path.read_text(encoding="utf-8"), jinja_path
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the chat template ({e})", path=jinja_path) from None
    value = tok_cfg.get("chat_template")
    if value is None:
        return None, None
    path = model_dir / "tokenizer_config.json"
    if isinstance(value, list):  # HF's list of {name, template}
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            value = named["default"]
    if not isinstance(value, str):
        raise TokenizerError(
            "unusable chat_template",
            path=path,
            field="chat_template",
            expected="a string or a list with a 'default' entry",
            got=type(value).__name__,
        )
    return value, path


def _fingerprint(model_dir: Path, id_cfgs: dict[str, dict]) -> str:
    """sha256 over tokenizer.json, the tokenizer-side files, and the token fields of the configs."""
    h = hashlib.sha256()
    for name in (TOKENIZER_FILE, *_FINGERPRINT_FILES):
        path = model_dir / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(f"{name}:{len(data)}:".encode())
        h.update(data)
    for name, cfg in sorted(id_cfgs.items()):
        fields = {k: cfg.get(k) for k in _TOKEN_FIELDS}
        h.update(f"{name}:{json.dumps(fields, sort_keys=True)}".encode())
    return h.hexdigest()


def parse_backend(source: str, *, plain: bool) -> Backend:
    """A backend from tokenizer.json text; `plain` encodes special-token text as characters."""
    backend = Backend.from_str(source)
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
