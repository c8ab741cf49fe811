r"""Chat prompts: messages → prompt text, and the think block of generated text (SPEC §6).

The checkpoint's chat template (a sandboxed Jinja template) renders the prompt; without one, the
built-in ChatML does::

    [BOS] <|im_start|>system\n{system}<|im_end|>\n    (only when a system prompt is given)
          <|im_start|>user\n{content}<|im_end|>\n
          <|im_start|>assistant\n<think>\n\n</think>\n\n   (empty think block: think=False)

A rendered prompt is a list of segments `(text, is_content)`: template scaffolding alternating
with message contents, so that the tokenizer (`salabatch.engine.tokenizer`) can parse special
tokens in the scaffolding only. Prompt text never contains the BOS text; the ids get BOS. This
module knows no token ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
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

# Stand-ins for message contents while a template renders: contents are spliced in afterwards,
# so the template never sees (and never re-parses) user text, and we know where each one sits.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000([0-9]+)\ue001")

Segment = tuple[str, bool]  # (text, is_content)


class ChatFormat:
    """Renders messages with a chat template, or with the built-in ChatML when there is none.

    `path` is named in errors: the template's file, or the model directory for ChatML.
    `has_token(text)` says whether the vocabulary has a token (ChatML needs `CHATML_TOKENS`).
    """

    def __init__(
        self,
        template: str | None,
        *,
        path: Path | None,
        bos_text: str | None,
        eos_text: str,
        has_token: Callable[[str], bool],
    ) -> None:
        self.path = path
        self._bos_text = bos_text
        self._eos_text = eos_text
        self._has_token = has_token
        self._template = compile_template(template, path) if template is not None else None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(
        self, messages: Sequence[dict], *, think: bool, add_generation_prompt: bool
    ) -> list[Segment]:
        """Segments of the prompt of `messages` ({'role': str, 'content': str} each)."""
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

    def document_prompt(
        self, document: str, question: str, *, system: str | None, think: bool
    ) -> tuple[list[Segment], list[Segment]]:
        """(document prompt, suffix) segments of a document question, cut right after the
        document.

        The user message is `document.strip() + DOC_QUESTION_SEP + question.strip()`; an empty
        document is refused (the cut must follow a non-space character, see
        `Tokenizer.split_chat_prompt`).
        """
        document, question = document.strip(), question.strip()
        if not document:
            raise TokenizerError(
                "document has no text", expected="non-whitespace text", got=document
            )
        messages, fills = [], []
        if system is not None:
            messages.append({"role": "system", "content": _MARK.format(0)})
            fills.append(system)
        n = len(fills)
        user = _MARK.format(n) + DOC_QUESTION_SEP + _MARK.format(n + 1)
        messages.append({"role": "user", "content": user})
        fills += [document, question]
        segments = self._render_marked(messages, fills, think=think, add_generation_prompt=True)
        # Segments alternate scaffold/content: content k sits at 2k + 1, the document at 2n + 1.
        cut = 2 * n + 2
        return segments[:cut], segments[cut:]

    def _render_marked(
        self, messages: list[dict], fills: list[str], *, think: bool, add_generation_prompt: bool
    ) -> list[Segment]:
        """Render with content markers, then splice contents in.

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
                path=self.path,
                field="chat_template",
            )
        scaffolds = parts[0::2]
        segments: list[Segment] = [(scaffolds[0], False)]
        for fill, scaffold in zip(fills, scaffolds[1:], strict=True):
            segments += [(fill, True), (scaffold, False)]
        return segments

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
        from jinja2 import TemplateError

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
                f"chat template failed: {e}", path=self.path, field="chat_template"
            ) from e


def compile_template(source: str, path: Path | None) -> Any:
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
