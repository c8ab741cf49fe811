r"""Tokenizer: load the tokenizer files, encode/decode, stop tokens, chat prompt ids (SPEC §6).

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

Prompt text is rendered by `salabatch.engine.chat` (the ChatML layout is shown there); streaming
decode is `salabatch.engine.detokenizer`; the demo tokenizer of `builtin:tiny` is built by
`salabatch.engine.demo_tokenizer`. Their public names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Backend

from salabatch.engine.chat import DOC_QUESTION_SEP, EMPTY_THINK, ChatFormat, Segment, split_thinking
from salabatch.engine.demo_tokenizer import (
    HEAD_TOKENS,
    MIN_DEMO_VOCAB,
    TAIL_TOKENS,
    build_byte_tokenizer,
)
from salabatch.engine.detokenizer import StreamingDetokenizer
from salabatch.engine.tokenizer_files import (
    TOKENIZER_FILE,
    continuation_source,
    id_list,
    parse_backend,
    read_backend,
    read_chat_template,
    read_json,
    reconcile_added_tokens,
    tokenizer_fingerprint,
)
from salabatch.errors import TokenizerError

__all__ = [
    "DOC_QUESTION_SEP",
    "EMPTY_THINK",
    "HEAD_TOKENS",
    "MIN_DEMO_VOCAB",
    "TAIL_TOKENS",
    "StreamingDetokenizer",
    "Tokenizer",
    "build_byte_tokenizer",
    "load_tokenizer",
    "split_thinking",
]

# --------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (see the module docstring for the files)."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise TokenizerError("not a directory", path=model_dir)
    backend = read_backend(model_dir)
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = read_json(tok_cfg_path)
    special_map = read_json(model_dir / "special_tokens_map.json")
    gen_cfg = read_json(model_dir / "generation_config.json")
    model_cfg = read_json(model_dir / "config.json")
    added = read_json(model_dir / "added_tokens.json")
    reconcile_added_tokens(backend, tok_cfg, added, model_dir)
    # Token ids of the configs, in precedence order.
    id_configs = (
        (gen_cfg, model_dir / "generation_config.json"),
        (model_cfg, model_dir / "config.json"),
    )

    def token_text(key: str) -> str | None:
        # tokenizer_config wins; HF writes tokens as "<s>" or {"content": "<s>", ...}
        for cfg in (tok_cfg, special_map):
            value = cfg.get(key)
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
            raise TokenizerError(f"{key} {text!r} is not in the vocabulary", path=tok_cfg_path)
        return tid

    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    bos_id = text_id("bos_token")
    if bos_id is None:
        for cfg, path in id_configs:
            ids = id_list(cfg, "bos_token_id", path, vocab_size)
            if ids:
                bos_id = ids[0]
                break

    eos: set[int] = set()
    for cfg, path in id_configs:  # HF generate stops on the configs' ids
        eos.update(id_list(cfg, "eos_token_id", path, vocab_size))
    if not eos and (eos_id := text_id("eos_token")) is not None:
        eos.add(eos_id)
    if not eos:
        raise TokenizerError(
            "no stop token: expected eos_token_id in generation_config.json or config.json, "
            "or eos_token in tokenizer_config.json",
            path=model_dir,
        )

    if "add_bos_token" in tok_cfg:
        add_bos_token = bool(tok_cfg["add_bos_token"])
    else:  # no explicit setting: follow what the backend's post-processor would have done
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        add_bos_token = bos_id is not None and full[:1] == [bos_id] and plain[:1] != [bos_id]

    template, template_path = read_chat_template(model_dir, tok_cfg)
    return Tokenizer(
        backend,
        model_dir=model_dir,
        bos_id=bos_id,
        eos_ids=frozenset(eos),
        add_bos_token=add_bos_token,
        eos_token=token_text("eos_token"),
        chat_template=template,
        chat_template_path=template_path,
        fingerprint=tokenizer_fingerprint(
            model_dir, {"config.json": model_cfg, "generation_config.json": gen_cfg}
        ),
    )


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
        # Four views of one vocabulary: special-token text parsed or not ("plain"), and with or
        # without the backend's word-start marker (see `_encode_piece`).
        source = backend.to_str()
        self._native = backend
        self._plain = parse_backend(source, plain=True)
        cont = continuation_source(source)
        self._cont = parse_backend(cont, plain=False) if cont is not None else None
        self._cont_plain = parse_backend(cont, plain=True) if cont is not None else None
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._chat = ChatFormat(
            chat_template,
            path=chat_template_path if chat_template is not None else model_dir,
            bos_text=backend.id_to_token(bos_id) if bos_id is not None else None,
            eos_text=eos_token or "",
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
        prefix, _ = self._chat.document_prompt(document, "", system=system, think=think)
        return self._prompt_start_ids(prefix)

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
        """Encode segments in order; contents as plain text, scaffolding with special tokens.

        `after_split` says whether the text so far ends at a split point of the backend (the
        prompt start or an added token); each piece updates it for the next.
        """
        ids: list[int] = []
        for text, is_content in segments:
            part = self._encode_piece(text, special=not is_content, after_split=after_split)
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
