r"""Tokenizer: encode/decode, stop tokens, chat prompt ids (SPEC §6).

`load_tokenizer(model_dir)` builds one from a checkpoint's tokenizer files, which
`tokenizer_files` reads and reconciles (which BOS, which stop tokens, the chat template).
Streaming decode is `detokenizer.StreamingDetokenizer`.

Policies, stated once:

* **BOS.** The backend tokenizer is always called with `add_special_tokens=False`, so its
  post-processor (MiniCPM's prepends `<s>`, id 1) never runs. BOS is added only by us: by
  `encode(text, add_bos=True)` and by every chat-prompt function (when `add_bos_token`, or
  where the chat template writes `{{ bos_token }}` first: transformers keeps that BOS whatever
  `add_bos_token` says). Chat prompt *strings* never contain the BOS text; the ids get the BOS
  id prepended, exactly once.
* **Special tokens.** `encode` turns special-token text (`<|im_end|>`) into its id. Inside a
  chat prompt, special-token text that comes from a message (document, question, system prompt)
  is encoded as plain text: a document that contains the text `<|im_start|>` cannot inject a
  turn. The rest of the prompt, the template's scaffolding and ordinary message text, is encoded
  as one text, so the ids are those of the rendered prompt (what transformers'
  `apply_chat_template` gives).

Prompt text is rendered by `salabatch.engine.chat` (the ChatML layout is shown there).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as _Backend

from salabatch.engine.chat import ChatFormat, Segment
from salabatch.engine.detokenizer import StreamingDetokenizer
from salabatch.engine.tokenizer_files import (
    TOKENIZER_FILE,
    TokenizerFiles,
    continuation_source,
    parse_backend,
    read_files,
)
from salabatch.errors import TokenizerError, not_utf8

if TYPE_CHECKING:
    from salabatch.engine.grammar import Grammars


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory (`tokenizer_files` says which files)."""
    model_dir = Path(model_dir).expanduser()
    return Tokenizer(model_dir, read_files(model_dir))


class Tokenizer:
    """Encode/decode text, build chat prompts, know the stop tokens. Built by `load_tokenizer`.

    Attributes: `bos_id` (int | None), `eos_ids` (frozenset[int]: the union of the
    `eos_token_id`s of generation_config.json and config.json, or else tokenizer_config's
    `eos_token`; {2, 73440} for the 9B), `vocab_size` (incl. added
    tokens), `add_bos_token` (chat prompts start with BOS), `fingerprint` (hex sha256 of the
    tokenizer files, for cache keys), `has_chat_template` (else built-in ChatML).
    """

    def __init__(self, model_dir: Path, files: TokenizerFiles) -> None:
        backend, bos_id, named_tokens = files.backend, files.bos_id, files.named_tokens
        chat_template = files.chat_template
        self.model_dir = model_dir
        self.bos_id = bos_id
        self.eos_ids = files.eos_ids
        self.add_bos_token = files.add_bos_token and bos_id is not None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.fingerprint = files.fingerprint
        # Four views of one vocabulary: special-token text parsed or not ("plain"), and with or
        # without the backend's word-start marker (see `_encode_piece`).
        source = backend.to_str()
        self._native = backend
        self._plain = parse_backend(source, plain=True)
        cont = continuation_source(source)
        self._cont = parse_backend(cont, plain=False) if cont is not None else None
        self._cont_plain = parse_backend(cont, plain=True) if cont is not None else None
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self._decoders = _decoder_kinds(json.loads(source).get("decoder"))
        # Added tokens the backend splits its input at, matched in the raw text and taking no
        # space before them: a text cut right before one encodes as its two sides (`_cuts_at`).
        self._cut_tokens = tuple(
            t.content for t in added.values() if not (t.lstrip or t.normalized or t.single_word)
        )
        bos_text = backend.id_to_token(bos_id) if bos_id is not None else None
        self._chat = ChatFormat(
            chat_template,
            path=files.chat_template_path if chat_template is not None else model_dir,
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
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        except TypeError:  # the backend takes only text UTF-8 can hold
            if bad := not_utf8(text):
                raise TokenizerError(f"the text is not UTF-8 ({bad})") from None
            raise
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

    def token_bytes(self, token: int) -> bytes:
        """The bytes `token` stands for in a decoded text, as OpenAI's logprobs give them (a
        piece of a multi-byte character is its own bytes, not U+FFFD): an added token's text;
        in a byte-level vocabulary (GPT-2's), its characters mapped back to their bytes; in a
        SentencePiece one, `▁` a space and a byte-fallback token (`<0x0A>`) its byte."""
        piece = self._native.id_to_token(int(token))
        if piece is None:
            raise TokenizerError(
                "token id out of range", expected=f"[0, {self.vocab_size})", got=token
            )
        if token in self._added_ids:
            return piece.encode()
        if "ByteLevel" in self._decoders:
            return bytes(_BYTE_OF[c] for c in piece)
        if "ByteFallback" in self._decoders and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if {"Metaspace", "Replace"} & self._decoders:
            piece = piece.replace("\u2581", " ")
        return piece.encode()

    @cached_property
    def grammars(self) -> Grammars:
        """The answer patterns compiled against this vocabulary (`engine.grammar`), each once
        for all who use this tokenizer (a server's requests, a run's rows)."""
        from salabatch.engine.grammar import Grammars

        return Grammars(self)

    def detokenizer(
        self, *, skip_special: bool = False, after: Sequence[int] = ()
    ) -> StreamingDetokenizer:
        """A fresh streaming decoder of this vocabulary (`after`: the tokens its text
        continues, see StreamingDetokenizer)."""
        path = self.model_dir / TOKENIZER_FILE
        return StreamingDetokenizer(self.backend, path, skip_special=skip_special, after=after)

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

    def chat_prompt_ids_after(
        self,
        messages: Sequence[dict],
        head: int,
        head_ids: Sequence[int],
        *,
        think: bool,
        add_generation_prompt: bool = True,
    ) -> list[int] | None:
        """`chat_prompt_ids(messages, ...)` without encoding its first `head` messages again:
        `head_ids` are `chat_prompt_ids(messages[:head], add_generation_prompt=False)` (a
        document in a system message, a conversation's turns), the rest's text is encoded on
        its own. Exact where the head's rendered text is the prompt's first text and the rest
        starts with an added token the backend splits at (a ChatML turn's `<|im_start|>`): the
        backend encodes the two sides of such a cut apart. None where it is not so (the caller
        encodes the whole prompt)."""
        if head == len(messages) and not add_generation_prompt:  # the head is the prompt
            return list(head_ids)
        whole = self._chat.render(
            messages, think=think, add_generation_prompt=add_generation_prompt
        )
        first = self._chat.render(messages[:head], think=think, add_generation_prompt=False)
        rest = _after(whole, first)
        if not rest or rest[0][1] or not head_ids or not self._cuts_at(rest[0][0]):
            return None
        ids = self._encode_segments(rest, after_split=head_ids[-1] in self._added_ids)
        return [*head_ids, *ids]

    def _cuts_at(self, text: str) -> bool:
        """Whether `text` starts with an added token the backend splits at (`_cut_tokens`)."""
        return any(text.startswith(t) for t in self._cut_tokens)

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
        """Ids of segments that start a prompt: BOS first when `add_bos_token`, or where the
        chat template writes it (as transformers keeps it)."""
        ids = self._encode_segments(segments, after_split=True)
        bos = self.add_bos_token or (self.bos_id is not None and self._chat.writes_bos)
        return self._with_bos(ids) if bos else ids

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


def byte_symbols() -> list[str]:
    """The printable stand-in for each byte 0..255 of a byte-level vocabulary (GPT-2's): the
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


_BYTE_OF = {c: b for b, c in enumerate(byte_symbols())}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(spec) -> frozenset[str]:
    """The types of a tokenizer.json `decoder` and of those a Sequence of them holds."""
    if not isinstance(spec, dict):
        return frozenset()
    inner = spec.get("decoders") or []
    return frozenset({str(spec.get("type"))}).union(*(_decoder_kinds(d) for d in inner))


def _after(whole: list[Segment], first: list[Segment]) -> list[Segment] | None:
    """The segments of `whole` after its first text `first` (a cut inside a segment of
    template text splits it); None where `first`'s text does not start `whole`'s, or the cut
    falls inside a message's plain text."""
    for i, (text, plain) in enumerate(first):
        if i >= len(whole):
            return None
        w_text, w_plain = whole[i]
        if (w_text, w_plain) == (text, plain):
            continue
        if i != len(first) - 1 or plain or w_plain or not w_text.startswith(text):
            return None
        return [(w_text[len(text) :], False), *whole[i + 1 :]]
    return list(whole[len(first) :])
