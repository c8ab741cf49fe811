r"""Tokenizer, chat prompts, stop tokens and streaming detokenization (SPEC §6).

`load_tokenizer(model_dir)` reads `tokenizer.json` (HF `tokenizers`) plus the optional
`tokenizer_config.json`, `special_tokens_map.json`, `added_tokens.json`, `chat_template.jinja`,
`generation_config.json` and `config.json`.

Policies, stated once:

* **BOS.** The backend tokenizer is always called with `add_special_tokens=False`, so its
  post-processor (MiniCPM's prepends `<s>`, id 1) never runs. BOS is added only by us: by
  `encode(text, add_bos=True)` and by every chat-prompt function (when `add_bos_token`). Chat
  prompt *strings* never contain the BOS text; the ids get the BOS id prepended, exactly once.
* **Special tokens.** `encode` turns special-token text (`<|im_end|>`) into its id. Message
  contents (documents, questions, system prompts) are encoded as plain text: a document that
  contains the text `<|im_start|>` cannot inject a turn. Only the template's own scaffolding is
  parsed for special tokens.
* **Prompt layout** (built-in ChatML, SPEC §6; `split_chat_prompt` shows the prefix/suffix cut)::

      [BOS] <|im_start|>system\n{system}<|im_end|>\n    (only when a system prompt is given)
            <|im_start|>user\n{content}<|im_end|>\n
            <|im_start|>assistant\n<think>\n\n</think>\n\n   (empty think block: think=False)
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from salabatch.errors import TokenizerError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Pre-seeded after the assistant header when think=False: the model then answers directly.
EMPTY_THINK = "<think>\n\n</think>\n\n"
# Joins document and question inside the one user message of a document prompt.
DOC_QUESTION_SEP = "\n\n"

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

# Stand-ins for message contents while a template renders: contents are spliced in afterwards,
# so the template never sees (and never re-parses) user text, and we know where each one sits.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000([0-9]+)\ue001")


# --------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (see the module docstring for the files)."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise TokenizerError("not a directory", path=model_dir)
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
        backend = _Backend.from_str(tok_path.read_text(encoding="utf-8"))
    except Exception as e:  # the Rust side raises a bare Exception
        raise TokenizerError(f"cannot parse: {e}", path=tok_path) from e

    tok_cfg = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")
    gen_cfg = _read_json(model_dir / "generation_config.json")
    model_cfg = _read_json(model_dir / "config.json")
    added = _read_json(model_dir / "added_tokens.json")
    _reconcile_added_tokens(backend, tok_cfg, added, model_dir)

    def token_text(key: str) -> str | None:
        # tokenizer_config wins; HF writes tokens as "<s>" or {"content": "<s>", ...}
        for cfg in (tok_cfg, special_map):
            value = (cfg or {}).get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                return value
        return None

    def text_id(key: str) -> int | None:
        text = token_text(key)
        if text is None:
            return None
        tid = backend.token_to_id(text)
        if tid is None:
            raise TokenizerError(
                f"{key} {text!r} is not in the vocabulary", path=model_dir / "tokenizer_config.json"
            )
        return tid

    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    bos_id = text_id("bos_token")
    if bos_id is None:
        for cfg, name in ((gen_cfg, "generation_config.json"), (model_cfg, "config.json")):
            ids = _id_list(cfg, "bos_token_id", model_dir / name, vocab_size)
            if ids:
                bos_id = ids[0]
                break

    eos: set[int] = set()
    for cfg, name in ((gen_cfg, "generation_config.json"), (model_cfg, "config.json")):
        eos.update(_id_list(cfg, "eos_token_id", model_dir / name, vocab_size))
    if not eos and text_id("eos_token") is not None:  # HF generate stops on the configs' ids
        eos.add(text_id("eos_token"))
    if not eos:
        raise TokenizerError(
            "no stop token: expected eos_token_id in generation_config.json or config.json, "
            "or eos_token in tokenizer_config.json",
            path=model_dir,
        )

    if tok_cfg is not None and "add_bos_token" in tok_cfg:
        add_bos_token = bool(tok_cfg["add_bos_token"])
    else:  # no explicit setting: follow what the backend's post-processor would have done
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        add_bos_token = bos_id is not None and full[:1] == [bos_id] and plain[:1] != [bos_id]

    template, template_path = None, None
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():  # transformers >= 4.43 saves the template here; it takes precedence
        template, template_path = jinja_path.read_text(encoding="utf-8"), jinja_path
    elif tok_cfg is not None and tok_cfg.get("chat_template") is not None:
        template = _pick_template(tok_cfg["chat_template"], model_dir / "tokenizer_config.json")
        template_path = model_dir / "tokenizer_config.json"

    return Tokenizer(
        backend,
        model_dir=model_dir,
        bos_id=bos_id,
        eos_ids=frozenset(eos),
        add_bos_token=add_bos_token,
        eos_token=token_text("eos_token"),
        chat_template=template,
        chat_template_path=template_path,
        fingerprint=_fingerprint(
            model_dir, {"config.json": model_cfg, "generation_config.json": gen_cfg}
        ),
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read JSON: {e}", path=path) from e
    if not isinstance(data, dict):
        raise TokenizerError("expected a JSON object", path=path, got=type(data).__name__)
    return data


def _id_list(cfg: dict | None, key: str, path: Path, vocab_size: int) -> list[int]:
    """`cfg[key]` as a list of token ids (HF allows an int or a list); [] when absent."""
    value = (cfg or {}).get(key)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise TokenizerError(
                "bad token id", path=path, field=key, expected=f"ints in [0, {vocab_size})", got=v
            )
    return list(values)


def _reconcile_added_tokens(
    backend: _Backend, tok_cfg: dict | None, added: dict | None, model_dir: Path
) -> None:
    """Check tokenizer_config's `added_tokens_decoder` and added_tokens.json against the backend.

    A listed token the backend lacks is added when its id is the next free one; any other
    disagreement is an error (a silently shifted special id would corrupt every prompt).
    """
    wanted: dict[int, tuple[str, bool]] = {}
    for tid, entry in ((tok_cfg or {}).get("added_tokens_decoder") or {}).items():
        if not str(tid).isdigit() or not isinstance(entry, dict):
            raise TokenizerError(
                "bad entry",
                path=model_dir / "tokenizer_config.json",
                field=f"added_tokens_decoder.{tid}",
                expected="an id string mapped to {'content': ...}",
            )
        if isinstance(entry.get("content"), str):
            wanted[int(tid)] = (entry["content"], bool(entry.get("special", True)))
    for content, tid in (added or {}).items():
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


def _fingerprint(model_dir: Path, cfgs: dict[str, dict | None]) -> str:
    """sha256 over tokenizer.json, the tokenizer-side files, and the token fields of the configs."""
    h = hashlib.sha256()
    for name in (TOKENIZER_FILE, *_FINGERPRINT_FILES):
        path = model_dir / name
        data = path.read_bytes() if path.is_file() else b""
        h.update(f"{name}:{len(data)}:".encode())
        h.update(data)
    for name, cfg in sorted(cfgs.items()):
        fields = {k: (cfg or {}).get(k) for k in _TOKEN_FIELDS}
        h.update(f"{name}:{json.dumps(fields, sort_keys=True)}".encode())
    return h.hexdigest()


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
    changed = False
    if part.get("type") == "Metaspace" and part.get("prepend_scheme", "never") != "never":
        part["prepend_scheme"] = "never"
        changed = True
    if part.get("add_prefix_space"):
        part["add_prefix_space"] = False
        changed = True
    return changed


# --------------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
    """Encode/decode text, build chat prompts, know the stop tokens. Built by `load_tokenizer`.

    Attributes: `bos_id` (int | None), `eos_ids` (frozenset[int]: the union of the
    `eos_token_id`s of generation_config.json and config.json, or else tokenizer_config's
    `eos_token`; {2, 73440} for the 9B), `vocab_size` (incl. added
    tokens), `add_bos_token` (chat prompts start with BOS), `fingerprint` (hex sha256 of the
    tokenizer files, for cache keys), `has_chat_template` (else built-in ChatML).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        model_dir: Path,
        bos_id: int | None,
        eos_ids: frozenset[int],
        add_bos_token: bool,
        eos_token: str | None,
        chat_template: str | None,
        chat_template_path: Path | None,
        fingerprint: str,
    ) -> None:
        self.model_dir = model_dir
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos_token = add_bos_token and bos_id is not None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = fingerprint
        self._bos_text = backend.id_to_token(bos_id) if bos_id is not None else None
        self._eos_text = eos_token or ""
        # Four views of one vocabulary: special-token text parsed or not ("plain"), and with or
        # without the backend's word-start marker (see `_encode_piece`).
        source = backend.to_str()
        self._native = backend
        self._plain = _Backend.from_str(source)
        self._plain.encode_special_tokens = True
        cfg = json.loads(source)
        if _without_prefix_marker(cfg):
            self._cont: _Backend | None = _Backend.from_str(json.dumps(cfg))
            self._cont_plain: _Backend | None = _Backend.from_str(json.dumps(cfg))
            self._cont_plain.encode_special_tokens = True
        else:
            self._cont = self._cont_plain = None
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._template_path = chat_template_path
        self._template = (
            _compile_template(chat_template, chat_template_path)
            if chat_template is not None
            else None
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.model_dir)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)}, "
            f"chat_template={self.has_chat_template})"
        )

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def backend(self) -> _Backend:
        """The HF `tokenizers.Tokenizer` (call it with add_special_tokens=False)."""
        return self._native

    # ---- plain text ------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, *, special: bool = True) -> list[int]:
        """Token ids of `text`; BOS first iff `add_bos` (never twice, even if text starts `<s>`).

        `special=True` maps special-token text such as `<|im_end|>` to its id; `special=False`
        encodes it as ordinary characters.
        """
        backend = self._native if special else self._plain
        ids = backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if add_bos else ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                "token id out of range", expected=f"[0, {self.vocab_size})", got=bad[0]
            )
        return self._native.decode(ids, skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        """Id of one vocabulary entry (e.g. `"<|im_end|>"`)."""
        tid = self._native.token_to_id(token)
        if tid is None:
            raise TokenizerError(
                f"token {token!r} is not in the vocabulary", path=self.model_dir / TOKENIZER_FILE
            )
        return tid

    def detokenizer(self, *, skip_special: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special=skip_special)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.bos_id is None:
            raise TokenizerError(
                "BOS requested but the tokenizer has none", path=self.model_dir / TOKENIZER_FILE
            )
        return ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    # ---- chat prompts ----------------------------------------------------------------------

    def chat_prompt(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text, without BOS (see module docstring for the ChatML layout).

        With `think=False` the assistant header is followed by an empty think block, so the
        model answers directly. `encode(chat_prompt(m, ...), add_bos=True)` equals
        `chat_prompt_ids(m, ...)` unless a message contains special-token text.
        """
        segments = self._render(messages, think=think, add_generation_prompt=add_generation_prompt)
        return "".join(text for text, _ in segments)

    def chat_prompt_ids(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of `chat_prompt(...)`: BOS (if `add_bos_token`), contents encoded as plain text."""
        segments = self._render(messages, think=think, add_generation_prompt=add_generation_prompt)
        ids, _ = self._encode_segments(segments, after_split=True)
        return self._with_bos(ids) if self.add_bos_token else ids

    def split_chat_prompt(
        self, document: str, question: str, *, system: str | None, think: bool
    ) -> tuple[list[int], list[int]]:
        r"""(prefix ids, suffix ids) of a document question; the prefix is shared by all questions.

        The user message is `document.strip() + "\n\n" + question.strip()`; the cut is right
        after the document. With the built-in ChatML::

            prefix: [BOS]<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{document}
            suffix: \n\n{question}<|im_end|>\n<|im_start|>assistant\n[<think>\n\n</think>\n\n]

        The two parts are tokenized separately, yet `prefix + suffix == chat_prompt_ids(...)` of
        the whole prompt: the cut sits between a non-space character and "\n" (ByteLevel and
        Metaspace pre-tokenizers split there; SentencePiece vocabularies keep "\n" a byte
        token), and the suffix is encoded as a continuation, without the word-start marker a
        SentencePiece-style backend puts at the start of a text. That is why the document and
        question are stripped and an empty document is refused. A template may make the prefix
        depend on `think`; the built-in ChatML does not.
        """
        return (
            self.prompt_prefix(document, system=system, think=think),
            self.prompt_suffix(question, system=system, think=think),
        )

    def prompt_prefix(self, document: str, *, system: str | None, think: bool) -> list[int]:
        """The prefix of `split_chat_prompt` (encode the document once, not once per question)."""
        segments, cut = self._document_segments(document, "", system=system, think=think)
        ids, _ = self._encode_segments(segments[:cut], after_split=True)
        return self._with_bos(ids) if self.add_bos_token else ids

    def prompt_suffix(self, question: str, *, system: str | None, think: bool) -> list[int]:
        """The suffix of `split_chat_prompt`; it does not depend on the document."""
        segments, cut = self._document_segments("-", question, system=system, think=think)
        # The document ends in a non-space character, so the suffix continues text.
        ids, _ = self._encode_segments(segments[cut:], after_split=False)
        return ids

    def _document_segments(
        self, document: str, question: str, *, system: str | None, think: bool
    ) -> tuple[list[tuple[str, bool]], int]:
        document, question = document.strip(), question.strip()
        if not document:
            raise TokenizerError(
                "document has no text", expected="non-whitespace text", got=document
            )
        n = 0 if system is None else 1
        messages = [{"role": "system", "content": _MARK.format(0)}] if system is not None else []
        fills = [system] if system is not None else []
        messages.append(
            {"role": "user", "content": _MARK.format(n) + DOC_QUESTION_SEP + _MARK.format(n + 1)}
        )
        fills += [document, question]
        segments = self._render_marked(messages, fills, think=think, add_generation_prompt=True)
        # Segments alternate scaffold/content, so content k sits at index 2k + 1.
        return segments, 2 * n + 2

    def _render(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool
    ) -> list[tuple[str, bool]]:
        marked, fills = [], []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TokenizerError(
                    "bad message", field=f"messages[{i}]", expected="{'role': str, 'content': str}"
                )
            if not isinstance(m.get("content"), str):
                raise TokenizerError(
                    "content must be a string",
                    field=f"messages[{i}].content",
                    got=type(m.get("content")).__name__,
                )
            marked.append({**m, "content": _MARK.format(i)})
            fills.append(m["content"])
        return self._render_marked(
            marked, fills, think=think, add_generation_prompt=add_generation_prompt
        )

    def _render_marked(
        self,
        messages: list[dict],
        fills: list[str],
        *,
        think: bool,
        add_generation_prompt: bool,
    ) -> list[tuple[str, bool]]:
        """Render with content markers, then splice contents in: [(text, is_content), ...].

        Always alternating, starting and ending with a scaffold segment (possibly empty).
        """
        if self._template is None:
            text = self._chatml(messages, add_generation_prompt)
        else:
            text = self._render_template(messages, think, add_generation_prompt)
        if add_generation_prompt and not think and not text.endswith(EMPTY_THINK):
            # The upstream template ignores enable_thinking (SPEC §6); seed the block ourselves.
            text += EMPTY_THINK
        if self._bos_text and text.startswith(self._bos_text):
            text = text[len(self._bos_text) :]  # BOS goes in as an id, never as text
        parts = _MARK_RE.split(text)  # [scaffold, index, scaffold, index, ..., scaffold]
        found = [int(p) for p in parts[1::2]]
        if found != list(range(len(fills))):
            raise TokenizerError(
                "chat template does not insert each message content exactly once, verbatim",
                path=self._template_path,
                field="chat_template",
            )
        segments: list[tuple[str, bool]] = []
        for i, scaffold in enumerate(parts[0::2]):
            segments.append((scaffold, False))
            if i < len(found):
                segments.append((fills[found[i]], True))
        return segments

    def _chatml(self, messages: list[dict], add_generation_prompt: bool) -> str:
        for token in ("<|im_start|>", "<|im_end|>"):
            if self._native.token_to_id(token) is None:
                raise TokenizerError(
                    f"no chat_template and no {token} token: cannot build a ChatML prompt",
                    path=self.model_dir,
                )
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def _render_template(self, messages: list[dict], think: bool, add_gen: bool) -> str:
        from jinja2 import TemplateError

        assert self._template is not None
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_gen,
                enable_thinking=think,
                bos_token=self._bos_text or "",
                eos_token=self._eos_text,
                tools=None,
                documents=None,
            )
        except TemplateError as e:
            raise TokenizerError(
                f"chat template failed: {e}", path=self._template_path, field="chat_template"
            ) from e

    def _encode_segments(
        self, segments: Iterable[tuple[str, bool]], *, after_split: bool
    ) -> tuple[list[int], bool]:
        """Encode segments in order; contents as plain text, scaffolding with special tokens.

        `after_split` says whether the text so far ends at a split point of the backend (the
        prompt start or an added token); it is threaded through and returned.
        """
        ids: list[int] = []
        for text, is_content in segments:
            part = self._encode_piece(text, special=not is_content, after_split=after_split)
            ids += part
            if part:
                after_split = part[-1] in self._added_ids
        return ids, after_split

    def _encode_piece(self, text: str, *, special: bool, after_split: bool) -> list[int]:
        """Encode `text` as it would be tokenized inside a longer prompt.

        The backend splits its input at added tokens and treats each split as a new text;
        SentencePiece-style backends then start each split with a word marker "▁". Text that
        continues a split (e.g. the question after the document) must not get one: its first
        split comes from the marker-free view, the rest from the normal one.
        """
        native = self._native if special else self._plain
        ids = native.encode(text, add_special_tokens=False).ids
        cont = self._cont if special else self._cont_plain
        if after_split or cont is None:
            return ids
        cont_ids = cont.encode(text, add_special_tokens=False).ids
        i = next((k for k, t in enumerate(ids) if t in self._added_ids), len(ids))
        j = next((k for k, t in enumerate(cont_ids) if t in self._added_ids), len(cont_ids))
        return cont_ids[:j] + ids[i:]


# --------------------------------------------------------------------------------------------
# Thinking


def split_thinking(text: str) -> tuple[str, str]:
    """(reasoning, answer) of generated text; both stripped of surrounding whitespace.

    A leading `<think>…</think>` block is the reasoning. An unterminated block (generation cut
    at max_tokens) is all reasoning and the answer is empty. Without a block: ("", text).
    """
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return "", text.strip()
    body = body[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(THINK_CLOSE) :].strip()


# --------------------------------------------------------------------------------------------
# Streaming detokenization


class StreamingDetokenizer:
    """Text of a growing token sequence, emitted as soon as it is stable.

    Each step decodes only a window: the tokens emitted at the last clean step (context, so that
    decoders which strip a leading space see the same neighbour as in a full decode) plus the
    tokens since. Text ending in U+FFFD (an incomplete UTF-8 character split across byte
    tokens) is held back until the character completes or `finalize()` is called. Cost per
    token is O(window), constant in practice.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._decode = tokenizer.backend.decode
        self._skip = skip_special
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._start = 0  # window start (token index)
        self._ctx_end = 0  # tokens [start, ctx_end) are context already emitted
        self._sent = 0  # chars of decode(tokens[start:]) already emitted
        self._chunks: list[str] = []
        self._unread: list[str] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        text = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            # Emit what is certain; the tail may still become a character.
            self._emit(text[self._sent : len(text.rstrip("\ufffd"))])
            self._sent = max(self._sent, len(text.rstrip("\ufffd")))
            return
        self._emit(text[self._sent :])
        # Clean boundary: the tokens just emitted become the next window's context.
        self._start, self._ctx_end = self._ctx_end, len(self.tokens)
        ctx = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        self._sent = len(ctx)

    def finalize(self) -> None:
        """Flush held-back text, U+FFFD included (the sequence ended mid-character)."""
        text = self._decode(self.tokens[self._start :], skip_special_tokens=self._skip)
        self._emit(text[self._sent :])
        self._sent = len(text)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def last_segment(self) -> str:
        """Text emitted since the last read of `last_segment`."""
        segment = "".join(self._unread)
        self._unread = []
        return segment

    def _emit(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._unread.append(piece)


# --------------------------------------------------------------------------------------------
# Sandboxed chat templates


def _compile_template(source: str, path: Path | None) -> Any:
    """Compile a Jinja chat template in an immutable sandbox (HF conventions and helpers)."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        # The stock sandbox renders an unsafe attribute as an empty Undefined; refuse outright.
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
            )

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(
            f"chat template does not compile: {e}", path=path, field="chat_template"
        ) from e


# --------------------------------------------------------------------------------------------
# The demo tokenizer of `builtin:tiny`

# Ids shared with the 9B: <unk> <s> </s> first, these 8 last (73440..73447 there).
HEAD_TOKENS = ("<unk>", "<s>", "</s>")
TAIL_TOKENS = (
    "<|im_end|>",
    "<|im_start|>",
    "<|tool_call|>",
    "<|execute_start|>",
    "<|execute_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
)
MIN_DEMO_VOCAB = len(HEAD_TOKENS) + 256 + len(TAIL_TOKENS)

# Training text for the demo merges; written for this file. Changing it changes the tokenizer.
_DEMO_CORPUS = """\
The archive opened at nine in the morning, and the first readers were already waiting on the
steps with their notebooks. Each of them had a question, and each question needed a document.
Some documents were short letters of a single page; others were reports of several hundred
pages, with tables, footnotes and appendices that nobody had read in years.

A good reader does not start at the first page and hope for the best. She looks at the table of
contents, finds the chapter that matters, and reads the summary before the details. When the
question is about money, she turns to the accounts. When the question is about people, she
looks for names, dates and places. When the question is about a promise, she reads the
contract, and she reads it twice, because the important words are often the small ones.

The river runs past the old library on its way to the sea. In spring the water is high and
brown; in summer it is low and clear, and children walk across the stones to the island in the
middle. The library has stood there for two hundred years. Its walls are thick, its windows are
tall, and its rooms are quiet even when the market outside is loud.

What is a summary? A summary keeps what matters and leaves out what does not. It answers the
questions a reader would ask first: who did what, when, where, and why. It is shorter than the
original, but it should not be vague. A summary that says "several issues were discussed" tells
the reader nothing; a summary that says "the parties agreed to pay the invoice within thirty
days" tells the reader something they can use.

Questions come in many forms. Some ask for a fact: the date of a meeting, the name of a
company, the amount of a payment. Some ask for a list: the risks of a project, the duties of a
tenant, the steps of a process. Some ask for an opinion, and those are the hardest, because the
answer must say where the opinion comes from and how strong the evidence is.

Numbers deserve special care. A report may say that sales grew by 12 percent in 2021, fell by
3 percent in 2022 and recovered in 2023. A careful reader checks whether the numbers add up,
whether the units are the same, and whether a table on page 40 agrees with the text on page 12.
Errors hide in the places where two parts of a document meet.

The weather was changing. Clouds came in from the west, the wind turned cold, and by the
afternoon the first drops of rain were falling on the windows of the reading room. The readers
did not notice. They were busy with their documents, turning pages, writing notes, and asking
the librarian for one more box from the basement.

Every answer should be honest about what it does not know. If the document does not say who
signed the agreement, the answer should say so, rather than guess. If two pages disagree, the
answer should point to both. A short answer that is right is worth more than a long answer that
is only partly right, and an answer that names its sources is worth more than one that does not.

Machines that read documents face the same problems as people. They must find the part of a
long text that answers the question, keep track of names and numbers across many pages, and
write an answer that is clear and complete. They read faster than people, but they can also be
wrong faster, so their answers should be checked, especially when a decision depends on them.

At the end of the day the librarian closed the windows, switched off the lamps and locked the
door. The rain had stopped. The river was louder than in the morning, and the streets were wet
and bright under the lights. Tomorrow there would be new readers, new questions and new
documents, and the archive would open again at nine.

Lists help readers: first, second, third; yes or no; before and after; cause and effect; north,
south, east and west; Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday;
January, February, March, April, May, June, July, August, September, October, November and
December. Code, too, has its words: def, return, import, class, for, while, if, else, print.
"""


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 used by the ByteLevel pre-tokenizer/decoder.

    Printable Latin-1 bytes stand for themselves; the others map to 256, 257, ... in order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _train_merges(words: Counter[str], budget: int, known: set[str]) -> list[tuple[str, str]]:
    """Byte-level BPE merges until `budget` new vocabulary entries exist (or no pairs remain).

    Deterministic: the most frequent pair wins, ties go to the lexicographically smallest pair.
    """
    seqs = [list(w) for w in sorted(words)]
    counts = [words[w] for w in sorted(words)]
    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for wi, seq in enumerate(seqs):
        for pair in pairwise(seq):
            pair_count[pair] += counts[wi]
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    added = 0
    while heap and added < budget:
        neg, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg or neg == 0:
            continue  # stale heap entry
        merges.append((a, b))
        if a + b not in known:
            known.add(a + b)
            added += 1
        touched: set[tuple[str, str]] = set()
        for wi in sorted(where.pop((a, b), ())):
            seq, c = seqs[wi], counts[wi]
            for pair in pairwise(seq):
                pair_count[pair] -= c
                touched.add(pair)
            merged, k = [], 0
            while k < len(seq):
                if k + 1 < len(seq) and seq[k] == a and seq[k + 1] == b:
                    merged.append(a + b)
                    k += 2
                else:
                    merged.append(seq[k])
                    k += 1
            seqs[wi] = merged
            for pair in pairwise(merged):
                pair_count[pair] += c
                touched.add(pair)
                where.setdefault(pair, set()).add(wi)
        for pair in sorted(touched):
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], *pair))
            else:
                del pair_count[pair]
    return merges


def build_byte_tokenizer(dest_dir: str | Path, vocab_size: int = 1024) -> int:
    """Write the demo tokenizer of `builtin:tiny` into `dest_dir`; return its vocabulary size.

    The builtin model is untrained: its weights are random and the text it generates is
    meaningless. This tokenizer only makes it run end to end, offline.

    Byte-level BPE: ids 0..2 are `<unk> <s> </s>`, then the 256 bytes (id 3 + byte), then merges
    trained deterministically on a small built-in English text, and the 8 chat/tool/FIM special
    tokens of the 9B as the last 8 ids (`<|im_end|>` = vocab_size - 8). Writes
    `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (eos = [2, <|im_end|>]),
    byte-for-byte the same on every run. The returned size is `vocab_size` unless the training
    text ran out of pairs first; the model config must use the returned value.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TokenizerError("bad vocab size", field="vocab_size", expected="int", got=vocab_size)
    if vocab_size < MIN_DEMO_VOCAB:
        raise TokenizerError(
            "vocab too small", field="vocab_size", expected=f">= {MIN_DEMO_VOCAB}", got=vocab_size
        )
    byte_tokens = _byte_symbols()
    vocab = {t: i for i, t in enumerate([*HEAD_TOKENS, *byte_tokens])}

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(w for w, _ in pre.pre_tokenize_str(_DEMO_CORPUS))
    budget = vocab_size - len(vocab) - len(TAIL_TOKENS)
    merges = _train_merges(words, budget, set(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))

    backend = _Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t in (*HEAD_TOKENS, *TAIL_TOKENS)]
    backend.add_special_tokens(specials)
    # Like MiniCPM's: the backend would prepend <s>. salabatch never lets it (module docstring).
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    final = backend.get_vocab_size(with_added_tokens=True)
    for i, tok in enumerate(HEAD_TOKENS):
        assert backend.token_to_id(tok) == i, tok  # construction invariant, not user input
    for i, tok in enumerate(TAIL_TOKENS):
        assert backend.token_to_id(tok) == final - len(TAIL_TOKENS) + i, tok

    im_end = backend.token_to_id("<|im_end|>")
    tok_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(backend.token_to_id(t)): {"content": t, "special": True}
            for t in (*HEAD_TOKENS, *TAIL_TOKENS)
        },
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 1048576,
        "salabatch_note": "demo tokenizer of builtin:tiny (an untrained model; output is noise)",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    gen_config = {"bos_token_id": 1, "eos_token_id": [2, im_end], "pad_token_id": 2}

    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    _write_atomic(dest / TOKENIZER_FILE, backend.to_str(pretty=True) + "\n")
    _write_atomic(dest / "tokenizer_config.json", _json_text(tok_config))
    _write_atomic(dest / "generation_config.json", _json_text(gen_config))
    return final


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
