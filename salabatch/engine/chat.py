r"""Chat prompts: messages → prompt text, and the think block of generated text (SPEC §6).

The checkpoint's chat template renders the prompt exactly as transformers' `apply_chat_template`
renders it: the same sandboxed Jinja environment (trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag), the same `tojson`, `raise_exception`, `strftime_now`, `dict` and
`namespace`, and the same variables (`messages`, `add_generation_prompt`, `tools`, `documents`,
the named special tokens such as `bos_token`/`eos_token`/`pad_token`, and `enable_thinking`, our
`think`). Messages go in as transformers passes them: keys whose value is None dropped, the
reasoning under `reasoning_content` and `thinking`. Two deliberate differences: the text never
starts with the BOS text (the ids get BOS, see `salabatch.engine.tokenizer`), and with
`think=False` an empty think block is seeded after the generation prompt when the template did
not write one (MiniCPM's template ignores `enable_thinking`). Without a template, the built-in
ChatML does::

    [BOS] <|im_start|>system\n{system}<|im_end|>\n    (only when a system prompt is given)
          <|im_start|>user\n{content}<|im_end|>\n
          <|im_start|>assistant\n<think>\n\n</think>\n\n   (empty think block: think=False)

Document injection. The template sees the real message strings, so its filters (`trim`,
slicing, `split`) act as in transformers; but special-token text inside any message string is
wrapped in two Unicode noncharacters first (markers are removed from the input beforehand, so
they cannot be forged). A rendered prompt is a list of segments `(text, plain)`: the wrapped
pieces come out as `plain` segments, which the tokenizer encodes as ordinary characters; the rest
(template scaffolding and ordinary message text) is parsed for special tokens. A template that
lets special-token text of a message through without its markers (it escapes or re-prints the
string: `tojson(ensure_ascii=true)`, printing a list) is refused with a TokenizerError rather than
parsed. Not caught, as in transformers: a template that builds special-token text out of pieces
of message text (case changes, joining two strings). This module knows no token ids.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from salabatch.errors import TokenizerError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Pre-seeded after the assistant header when think=False: the model then answers directly.
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"
# Joins document and question inside the one user message of a document prompt.
DOC_QUESTION_SEP = "\n\n"
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")

# Noncharacters (reserved by Unicode for internal use): around special-token text of messages,
# and where a document prompt is cut. Removed from every message string before rendering.
_OPEN, _CLOSE, _CUT = "\ufdd0", "\ufdd1", "\ufdd2"
_MARKERS = re.compile(f"[{_OPEN}{_CLOSE}{_CUT}]")
# A wrapped piece, or a lone marker (a template string method split a pair): the latter is
# dropped but still separates the text on either side, so that it cannot join into a token.
_PIECE = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}|[{_OPEN}{_CLOSE}]")
# Other names transformers passes a message's reasoning under; the first is what templates read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

Segment = tuple[str, bool]  # (text, plain): plain text is never parsed for special tokens


class ChatFormat:
    """Renders messages with a chat template, or with the built-in ChatML when there is none.

    `path` is named in errors: the template's file, or the model directory for ChatML.
    `special_tokens` are the template's named tokens (`{"bos_token": "<s>", ...}`);
    `control_tokens` the texts never parsed inside messages (the special added tokens);
    `has_token(text)` says whether the vocabulary has a token (ChatML needs `CHATML_TOKENS`).
    """

    def __init__(
        self,
        template: str | None,
        *,
        path: Path | None,
        bos_text: str | None,
        special_tokens: Mapping[str, str],
        control_tokens: Iterable[str],
        has_token: Callable[[str], bool],
    ) -> None:
        self.path = path
        self._bos_text = bos_text
        self._special_tokens = dict(special_tokens)
        longest_first = sorted({t for t in control_tokens if t}, key=len, reverse=True)
        self._control = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )
        self._has_token = has_token
        self._template = compile_template(template, path) if template is not None else None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    @functools.cached_property
    def writes_bos(self) -> bool:
        """Whether the template opens a prompt with BOS's text (`{{ bos_token }}`), read from a
        one-message render: transformers' `apply_chat_template` then keeps BOS whatever
        `add_bos_token` says, and so do chat prompts here (the text is cut off, BOS goes in as
        its id). A template that cannot render one user message does not say."""
        if self._template is None or not self._bos_text:
            return False
        try:
            text = self._render_template([{"role": "user", "content": "x"}], False, True)
        except TokenizerError:
            return False
        return text.startswith(self._bos_text)

    def render(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool
    ) -> list[Segment]:
        """Segments of the prompt of `messages` ({'role': str, 'content': str, ...} each)."""
        checked = [_template_message(i, m) for i, m in enumerate(messages)]
        text = self._render_safely(
            lambda t: [_map_strings(m, t) for m in checked], think, add_generation_prompt
        )
        return _segments(text)

    def document_prompt(
        self, document: str, question: str, *, system: str | None, think: bool
    ) -> tuple[list[Segment], list[Segment]]:
        """(document prompt, suffix) segments of a document question, cut right after the
        document.

        The user message is `document.strip() + DOC_QUESTION_SEP + question.strip()`; an empty
        document is refused (the cut must follow a non-space character, see
        `Tokenizer.split_chat_prompt`). The template must write the document exactly once.
        """
        document, question = document.strip(), question.strip()
        if not document:
            raise TokenizerError(
                "document has no text", expected="non-whitespace text", got=document
            )

        def build(t: Callable[[str], str]) -> list[dict]:
            user = t(document) + _CUT + DOC_QUESTION_SEP + t(question)
            head = [{"role": "system", "content": t(system)}] if system is not None else []
            return [*head, {"role": "user", "content": user}]

        parts = self._render_safely(build, think, True).split(_CUT)
        if len(parts) != 2:
            raise TokenizerError(
                "chat template does not write the user message's document exactly once",
                path=self.path,
                field="chat_template",
            )
        return _segments(parts[0]), _segments(parts[1])

    def _render_safely(
        self,
        build: Callable[[Callable[[str], str]], list[dict]],
        think: bool,
        add_generation_prompt: bool,
    ) -> str:
        """Text of the messages `build(t)` makes, `t` applied to each of their strings, with the
        special-token text of those strings marked.

        When there was any, the template is rendered once more with it removed: the text outside
        the marked pieces must hold no more special tokens than that render (else the template
        let message text through unmarked, and it is refused).
        """
        marked = build(self._mark)
        text = self._text(marked, think, add_generation_prompt)
        neutral = build(self._remove_tokens)
        if neutral != marked:
            bare = self._text(neutral, think, add_generation_prompt)
            parsed = "".join(t for t, plain in _segments(text.replace(_CUT, "")) if not plain)
            if self._count_tokens(parsed) > self._count_tokens(bare.replace(_CUT, "")):
                raise TokenizerError(
                    "chat template writes special-token text of a message without its markers "
                    "(it escapes or re-prints the string); refusing to parse it as tokens",
                    path=self.path,
                    field="chat_template",
                )
        return text

    def _mark(self, text: str) -> str:
        text = _MARKERS.sub("", text)
        return self._control.sub(lambda m: _OPEN + m[0] + _CLOSE, text) if self._control else text

    def _remove_tokens(self, text: str) -> str:
        text = _MARKERS.sub("", text)
        return self._control.sub("", text) if self._control else text

    def _count_tokens(self, text: str) -> int:
        return len(self._control.findall(text)) if self._control else 0

    def _text(self, messages: list[dict], think: bool, add_generation_prompt: bool) -> str:
        """The rendered prompt, less a leading BOS text, with the think seed (module docstring)."""
        if self._template is None:
            text = self._chatml(messages, add_generation_prompt)
        else:
            text = self._render_template(messages, think, add_generation_prompt)
        if add_generation_prompt and not think and not text.endswith(EMPTY_THINK):
            # The upstream template ignores enable_thinking (SPEC §6); seed the block ourselves.
            text += EMPTY_THINK
        if self._bos_text and text.startswith(self._bos_text):
            text = text[len(self._bos_text) :]  # BOS goes in as an id, never as text
        return text

    def _chatml(self, messages: list[dict], add_generation_prompt: bool) -> str:
        for token in CHATML_TOKENS:
            if not self._has_token(token):
                raise TokenizerError(
                    f"no chat_template and no {token} token: cannot build a ChatML prompt",
                    path=self.path,
                )
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def _render_template(self, messages: list[dict], think: bool, add_gen: bool) -> str:
        # As transformers: the named special tokens first, the call's own variables over them.
        variables = {
            **self._special_tokens,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_gen,
            "enable_thinking": think,
        }
        try:
            return self._template.render(**variables)
        except Exception as e:  # template code can raise anything (TemplateError, TypeError, ...)
            raise TokenizerError(
                f"chat template failed: {e}", path=self.path, field="chat_template"
            ) from e


def _template_message(i: int, m: Any) -> dict:
    """Message `i` as transformers hands it to a template: None values dropped, the reasoning
    under its standard names."""
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
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def _map_strings(value: Any, t: Callable[[str], str]) -> Any:
    """`value` with `t` applied to every string in it (dict keys excepted)."""
    if isinstance(value, str):
        return t(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, t) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_map_strings(v, t) for v in value)
    if isinstance(value, list):
        return [_map_strings(v, t) for v in value]
    return value


def _segments(text: str) -> list[Segment]:
    """Split rendered text at its marked pieces: (unmarked text, False), (piece, True), ...

    Empty texts are left out; a lone marker only separates the texts around it.
    """
    segments: list[Segment] = []
    start = 0
    for m in _PIECE.finditer(text):
        if start < m.start():
            segments.append((text[start : m.start()], False))
        if m[1]:
            segments.append((m[1], True))
        start = m.end()
    if start < len(text):
        segments.append((text[start:], False))
    return segments


def compile_template(source: str, path: Path | None) -> Any:
    """Compile a Jinja chat template in the immutable sandbox transformers renders it in."""
    from jinja2 import TemplateError, nodes
    from jinja2.exceptions import SecurityError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Sandbox(ImmutableSandboxedEnvironment):
        # The stock sandbox renders an unsafe attribute as an empty Undefined; refuse outright.
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
            )

    class GenerationTag(Extension):
        """`{% generation %}…{% endgeneration %}` marks assistant text for training masks;
        rendering writes its body unchanged (in its own scope, a call block, as transformers)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class TemplateNamespace(Namespace):
        """`namespace()` whose attributes cannot start with "_" (no way to CPython internals)."""

        def __setitem__(self, name: str, value: Any) -> None:
            _check_attribute(name)
            super().__setitem__(name, value)

    def _check_attribute(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set namespace attribute {name!r}")

    def namespace(*args: Any, **kwargs: Any) -> TemplateNamespace:
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _check_attribute(name)
        return TemplateNamespace(attributes)

    class Dicts:
        """`dict` in templates: builds dicts without handing out the `dict` type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, keys: Iterable, value: Any = None) -> dict:
            return dict.fromkeys(keys, value)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (transformers' order
        # of arguments: `x | tojson(true)` means ensure_ascii).
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=Dicts(),
        namespace=namespace,
    )
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(
            f"chat template does not compile: {e}", path=path, field="chat_template"
        ) from e


def split_thinking(text: str, strip: bool = True) -> tuple[str, str]:
    """(reasoning, answer) of generated text; both stripped of surrounding whitespace.

    A leading `<think>…</think>` block is the reasoning. An unterminated block (generation cut
    at max_tokens) is all reasoning and the answer is empty. Without a block: ("", text).
    Without `strip` (an answer held to a pattern: its spaces are its text) the answer keeps
    its whitespace, but for what separates it from a think block.
    """
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return "", text.strip() if strip else text
    body = body[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip(), ""
    answer = body[end + len(THINK_CLOSE) :].lstrip()
    return body[:end].strip(), answer.rstrip() if strip else answer


class ThinkingTokens:
    """The generated tokens of a leading `<think>…</think>` block, counted as they come (what
    OpenAI's `reasoning_tokens` counts): every token while the text so far may still open the
    block or is inside it, the one that closes it included; all of them where the block never
    closes; none where the text opens no block (an answer that ends while it may still open
    one, `"<"` or blank, included). `add` takes the text so far after each token."""

    def __init__(self) -> None:
        self._count = 0
        self._done = False
        self._inside: int | None = None  # where the block's text starts, once opened

    @property
    def count(self) -> int:
        return 0 if self._inside is None else self._count

    def add(self, text: str) -> None:
        if self._done:
            return
        self._count += 1
        if self._inside is None:
            head = text.lstrip()
            if THINK_OPEN.startswith(head) and head != THINK_OPEN:  # may still open one
                return
            if not head.startswith(THINK_OPEN):
                self._done = True
                return
            self._inside = len(text) - len(head) + len(THINK_OPEN)
        # the closing tag looked for only where it can end: in what this token added
        found = text.find(THINK_CLOSE, self._inside)
        self._done = found >= 0
        self._inside = max(self._inside, len(text) - len(THINK_CLOSE) + 1)
