r"""Tokenizer: a checkpoint's tokenizer files, encode/decode, stop tokens, chat prompt ids and
streaming decode (SPEC §6).

`load_tokenizer(model_dir)` reads `tokenizer.json` (HF `tokenizers`) plus the optional
`tokenizer_config.json`, `special_tokens_map.json`, `added_tokens.json`, `chat_template.jinja`,
`generation_config.json` and `config.json`. It decides what the files mean (which BOS, which
stop tokens); the readers below it know their formats (where HF writes what, and the ways it
varies).

Policies, stated once:

* **BOS.** The backend tokenizer is always called with `add_special_tokens=False`, so its
  post-processor (MiniCPM's prepends `<s>`, id 1) never runs. BOS is added only by us: by
  `encode(text, add_bos=True)` and by every chat-prompt function (when `add_bos_token`). Chat
  prompt *strings* never contain the BOS text; the ids get the BOS id prepended, exactly once.
* **Special tokens.** `encode` turns special-token text (`<|im_end|>`) into its id. Inside a
  chat prompt, special-token text that comes from a message (document, question, system prompt)
  is encoded as plain text: a document that contains the text `<|im_start|>` cannot inject a
  turn. The rest of the prompt, the template's scaffolding and ordinary message text, is encoded
  as one text, so the ids are those of the rendered prompt (what transformers'
  `apply_chat_template` gives).

Prompt text is rendered by `salabatch.engine.chat` (the ChatML layout is shown there). The demo
tokenizer of `builtin:tiny` is built by `salabatch.demo.tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from salabatch.engine.chat import ChatFormat, Segment
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

# --------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (see the module docstring for the files)."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise TokenizerError("not a directory", path=model_dir)
    backend = _read_backend(model_dir)
    cfgs = {name: _read_json(model_dir / name) for name in _JSON_FILES}
    tok_cfg = cfgs["tokenizer_config.json"]
    _reconcile_added_tokens(backend, tok_cfg, cfgs["added_tokens.json"], model_dir)
    bos_id = _bos_id(backend, cfgs, model_dir)
    eos_ids = _eos_ids(backend, cfgs, model_dir)
    template, template_path = _read_chat_template(model_dir, tok_cfg)
    return Tokenizer(
        backend,
        model_dir=model_dir,
        bos_id=bos_id,
        eos_ids=eos_ids,
        add_bos_token=_adds_bos(backend, tok_cfg, bos_id),
        named_tokens=_named_tokens(cfgs),
        chat_template=template,
        chat_template_path=template_path,
        fingerprint=_fingerprint(model_dir, {name: cfgs[name] for name in _ID_CONFIGS}),
    )


def _bos_id(backend: _Backend, cfgs: dict[str, dict], model_dir: Path) -> int | None:
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


def _eos_ids(backend: _Backend, cfgs: dict[str, dict], model_dir: Path) -> frozenset[int]:
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


def _adds_bos(backend: _Backend, tok_cfg: dict, bos_id: int | None) -> bool:
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
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (text := _content(cfgs[name].get(key))) is not None:
            return text
    return None


def _content(value: Any) -> str | None:
    """The text of a token entry: HF writes "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _text_id(backend: _Backend, cfgs: dict[str, dict], key: str, model_dir: Path) -> int | None:
    """The id of special token `key` (see `_token_text`); None when no file names it."""
    text = _token_text(cfgs, key)
    if text is None:
        return None
    tid = backend.token_to_id(text)
    if tid is None:
        raise TokenizerError(
            f"{key} {text!r} is not in the vocabulary", path=model_dir / "tokenizer_config.json"
        )
    return tid


def _read_backend(model_dir: Path) -> _Backend:
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


def _read_json(path: Path) -> dict[str, Any]:
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


def _reconcile_added_tokens(backend: _Backend, tok_cfg: dict, added: dict, model_dir: Path) -> None:
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


def _read_chat_template(model_dir: Path, tok_cfg: dict) -> tuple[str | None, Path | None]:
    """(template source, the file it came from), or (None, None) when there is none."""
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():  # transformers >= 4.43 saves the template here; it takes precedence
        return jinja_path.read_text(encoding="utf-8"), jinja_path
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
        named_tokens: dict[str, str],
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
        # Four views of one vocabulary: special-token text parsed or not ("plain"), and with or
        # without the backend's word-start marker (see `_encode_piece`).
        source = backend.to_str()
        self._native = backend
        self._plain = _parse_backend(source, plain=True)
        cont = _continuation_source(source)
        self._cont = _parse_backend(cont, plain=False) if cont is not None else None
        self._cont_plain = _parse_backend(cont, plain=True) if cont is not None else None
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        bos_text = backend.id_to_token(bos_id) if bos_id is not None else None
        self._chat = ChatFormat(
            chat_template,
            path=chat_template_path if chat_template is not None else model_dir,
            bos_text=bos_text,
            # A BOS known only by id (config.json) still reaches the template as bos_token.
            special_tokens={"bos_token": bos_text, **named_tokens} if bos_text else named_tokens,
            control_tokens=[t.content for t in added.values() if t.special],
            has_token=lambda text: backend.token_to_id(text) is not None,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.model_dir)!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)}, "
            f"chat_template={self.has_chat_template})"
        )

    @property
    def has_chat_template(self) -> bool:
        return self._chat.has_template

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
        """A fresh streaming decoder of this vocabulary."""
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
        """The prompt text, without BOS (`salabatch.engine.chat` shows the ChatML layout).

        With `think=False` the assistant header is followed by an empty think block, so the
        model answers directly. `encode(chat_prompt(m, ...), add_bos=True)` equals
        `chat_prompt_ids(m, ...)` unless a message contains special-token text.
        """
        segments = self._chat.render(
            messages, think=think, add_generation_prompt=add_generation_prompt
        )
        return "".join(text for text, _ in segments)

    def chat_prompt_ids(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of `chat_prompt(...)`: BOS (if `add_bos_token`), contents encoded as plain text."""
        segments = self._chat.render(
            messages, think=think, add_generation_prompt=add_generation_prompt
        )
        return self._prompt_start_ids(segments)

    def split_chat_prompt(
        self, document: str, question: str, *, system: str | None, think: bool
    ) -> tuple[list[int], list[int]]:
        r"""(document prompt ids, suffix ids) of a document question; the document prompt is
        shared by all questions.

        The user message is `document.strip() + "\n\n" + question.strip()`; the cut is right
        after the document. With the built-in ChatML::

            doc_prompt: [BOS]<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{document}
            suffix:     \n\n{question}<|im_end|>\n<|im_start|>assistant\n[<think>\n\n</think>\n\n]

        The two parts are tokenized separately, yet `doc_prompt + suffix == chat_prompt_ids(...)`
        of the whole prompt: the cut sits between a non-space character and "\n" (ByteLevel and
        Metaspace pre-tokenizers split there; SentencePiece vocabularies keep "\n" a byte
        token), and the suffix is encoded as a continuation, without the word-start marker a
        SentencePiece-style backend puts at the start of a text. That is why the document and
        question are stripped and an empty document is refused. A template may make the document
        prompt depend on `think`; the built-in ChatML does not.
        """
        return (
            self.document_prompt(document, system=system, think=think),
            self.prompt_suffix(question, system=system, think=think),
        )

    def document_prompt(self, document: str, *, system: str | None, think: bool) -> list[int]:
        """The document prompt of `split_chat_prompt` (encode the document once, not once per
        question)."""
        segments, _ = self._chat.document_prompt(document, "", system=system, think=think)
        return self._prompt_start_ids(segments)

    def prompt_suffix(self, question: str, *, system: str | None, think: bool) -> list[int]:
        """The suffix of `split_chat_prompt`; it does not depend on the document."""
        _, suffix = self._chat.document_prompt("-", question, system=system, think=think)
        # The document ends in a non-space character, so the suffix continues text.
        return self._encode_segments(suffix, after_split=False)

    def _prompt_start_ids(self, segments: list[Segment]) -> list[int]:
        """Ids of segments that start a prompt: BOS first when `add_bos_token`."""
        ids = self._encode_segments(segments, after_split=True)
        return self._with_bos(ids) if self.add_bos_token else ids

    def _encode_segments(self, segments: list[Segment], *, after_split: bool) -> list[int]:
        """Encode segments in order; plain ones as plain text, the others with special tokens.

        `after_split` says whether the text so far ends at a split point of the backend (the
        prompt start or an added token); each piece updates it for the next.
        """
        ids: list[int] = []
        for text, plain in segments:
            part = self._encode_piece(text, special=not plain, after_split=after_split)
            ids += part
            if part:
                after_split = part[-1] in self._added_ids
        return ids

    def _encode_piece(self, text: str, *, special: bool, after_split: bool) -> list[int]:
        """Encode `text` as it would be tokenized inside a longer prompt.

        The backend splits its input at added tokens and treats each split as a new text;
        SentencePiece-style backends then start each split with a word marker "▁". Text that
        continues a split (e.g. the question after the document) must not get one: its first
        split comes from the marker-free view, the rest from the normal one.
        """
        ids = self.encode(text, special=special)
        cont = self._cont if special else self._cont_plain
        if after_split or cont is None:
            return ids
        cont_ids = cont.encode(text, add_special_tokens=False).ids
        i = next((k for k, t in enumerate(ids) if t in self._added_ids), len(ids))
        j = next((k for k, t in enumerate(cont_ids) if t in self._added_ids), len(cont_ids))
        return cont_ids[:j] + ids[i:]


def _parse_backend(source: str, *, plain: bool) -> _Backend:
    """A backend from tokenizer.json text; `plain` encodes special-token text as characters."""
    backend = _Backend.from_str(source)
    backend.encode_special_tokens = plain
    return backend


def _continuation_source(source: str) -> str | None:
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


# --------------------------------------------------------------------------------------------
# Streaming decode


class StreamingDetokenizer:
    """Text of a growing token sequence, emitted as soon as it is stable.

    The backend's `DecodeStream` decodes a short window per token: the tokens of the last
    emitted piece (context, so that decoders which strip a leading space see the same neighbour
    as in a full decode) plus the new ones. Text ending in U+FFFD (an incomplete UTF-8 character
    split across byte tokens) is held back until the character completes or `finalize()` is
    called. Cost per token is O(window), constant in practice.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False) -> None:
        self._backend = tokenizer.backend
        self._skip = skip_special
        self._path = tokenizer.model_dir / TOKENIZER_FILE
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._held = 0  # tokens added since the last emitted piece
        self._chunks: list[str] = []
        self._unread: list[str] = []

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        try:
            piece = self._stream.step(self._backend, self.tokens[-1])
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"streaming decode failed: {e}", path=self._path) from e
        if piece is None:
            self._held += 1
        else:
            self._held = 0
            self._emit(piece)

    def finalize(self) -> None:
        """Flush held-back text, U+FFFD included (the sequence ended mid-character).

        Call it once, when the sequence has ended.
        """
        if self._held:
            full = self._backend.decode(self.tokens, skip_special_tokens=self._skip)
            self._emit(full[len(self.text) :])
            self._held = 0

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
