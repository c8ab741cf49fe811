"""One completion over the serving engine, as the HTTP server and the terminal chat both make
it: the Job of chat messages (the chat template's prompt, with a boundary at the end of the
leading system messages and of the last message, so that requests sharing a document share its
prefill and the next turn of a conversation resumes where this one's messages end) or of a text
prompt, and the answer's tokens turned into text as it streams (stop strings held back until
they cannot be one, a leading <think> block split off as the reasoning).

Where no message boundary marks the document off (a text prompt; a document in the user message
with its question), a job has one `QUESTION_TAIL` tokens before its end: the question after a
document is most often what the next prompt over it changes (a client asking many questions of a
document, lm-eval's choices after one context), and the engine's snapshot there lets that next
prompt prefill only its own last tokens.

A server asked many questions of one document tokenizes it once: `LeadingIds` keeps the ids of
recent leading system messages, and a request's prompt is those ids followed by the rest's
(`Tokenizer.chat_prompt_ids_after`, where the template cuts there), so a request over a
document seen lately tokenizes only its own messages.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from salabatch.engine.chat import THINK_CLOSE, THINK_OPEN, ThinkingTokens
from salabatch.engine.sampling import SamplingParams, TokenLogprob
from salabatch.engine.tokenizer import Tokenizer
from salabatch.errors import TokenizerError
from salabatch.openai_api import BodyError
from salabatch.serve.engine import Finished, Job

LEADING_IDS_TOKENS = 1 << 22  # ids `LeadingIds` holds at most (16 MB as int32)
# A prompt's own last tokens a boundary lies before, where no message boundary lies there (the
# module docstring): a later prompt that differs from it only in as many resumes there. Under the
# engine's snapshot_min (256), so the engine holds no second snapshot at the prompt's end (a copy)
QUESTION_TAIL = 128


def new_id(kind: str) -> str:
    """A fresh response id, OpenAI's shape: `chatcmpl-<32 hex>`, `cmpl-<32 hex>`."""
    return f"{kind}-{uuid.uuid4().hex}"


class LeadingIds:
    """The token ids of the leading system messages of recent chat requests (a document many
    requests send), for `chat_job`'s first boundary: `ids(messages, think)` is
    `tok.chat_prompt_ids(messages, think=think, add_generation_prompt=False)`, tokenized once
    per document. At most `tokens` ids are held, the least recently used dropped first.
    Thread-safe (jobs are made in worker threads)."""

    def __init__(self, tok: Tokenizer, tokens: int = LEADING_IDS_TOKENS) -> None:
        self.tok, self.tokens = tok, tokens
        self._held: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()
        self._count = 0  # ids held
        self._lock = threading.Lock()

    def ids(self, messages: Sequence[dict], think: bool) -> np.ndarray:
        """[n] int32: the ids of `messages` without a generation prompt (TokenizerError where
        the template refuses them)."""
        text = json.dumps(list(messages), sort_keys=True, ensure_ascii=False, default=str)
        key = (hashlib.sha256(text.encode()).hexdigest(), think)
        with self._lock:
            ids = self._held.get(key)
            if ids is not None:
                self._held.move_to_end(key)
                return ids
        found = self.tok.chat_prompt_ids(messages, think=think, add_generation_prompt=False)
        ids = np.asarray(found, dtype=np.int32)
        with self._lock:
            if key not in self._held and len(ids) <= self.tokens:
                self._held[key] = ids
                self._count += len(ids)
                while self._count > self.tokens:
                    self._count -= len(self._held.popitem(last=False)[1])
        return ids


def chat_job(
    tok: Tokenizer,
    messages: Sequence[dict],
    *,
    think: bool,
    params: SamplingParams,
    max_tokens: int,
    stop_strings: tuple[str, ...] = (),
    job_id: str | None = None,
    leading_ids: LeadingIds | None = None,
) -> Job:
    """The Job of chat `messages` ({"role", "content"} each). Boundaries: where the leading
    system messages end (a document there is prefilled once for every request that shares it)
    and where the last message ends (the next turn of the conversation continues from there);
    each only where its tokens are exactly a prefix of the whole prompt's; and `QUESTION_TAIL`
    tokens before the end where no leading system message marks a document off (`tail`).
    Stops at the tokenizer's end-of-turn and eos tokens.

    Each part is tokenized once: the leading system messages (by `leading_ids`, of `tok`, once
    per document across requests), then the messages after them, then the generation prompt,
    each part's ids following the ones before (`Tokenizer.chat_prompt_ids_after`); where the
    template does not cut there, the whole text up to that point again. Call it off the event
    loop."""
    if leading_ids is not None and leading_ids.tok is not tok:
        raise ValueError("leading_ids holds another tokenizer's ids")
    leading = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    marks = {}  # the ids of the messages up to each boundary, without a generation prompt
    head, head_ids = 0, []
    for end in sorted({leading, len(messages)} - {0}):
        try:
            if end == leading and leading_ids is not None:
                ids = leading_ids.ids(messages[:end], think).tolist()
            else:
                ids = _ids_after(tok, messages[:end], head, head_ids, think, False)
        except TokenizerError:  # a template may refuse a conversation without a user message
            continue
        marks[end] = ids
        head, head_ids = end, ids
    prompt = _ids_after(tok, messages, head, head_ids, think, True)
    exact = {
        end: len(ids)
        for end, ids in marks.items()
        if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids
    }
    boundaries = sorted(exact.values())
    if not (leading < len(messages) and leading in exact):  # no document marked off
        boundaries = tail(len(prompt), boundaries)
    return Job(
        job_id or new_id("chatcmpl"),
        tuple(prompt),
        params,
        max_tokens,
        frozenset(tok.eos_ids),
        stop_strings,
        tuple(boundaries),
    )


def tail(n: int, boundaries: Sequence[int]) -> list[int]:
    """A prompt of n tokens' `boundaries` and `QUESTION_TAIL` tokens before its end (where the
    prompt is longer), in order."""
    at = n - QUESTION_TAIL
    return sorted({*boundaries, at} if at > 0 else set(boundaries))


def _ids_after(tok, messages, head, head_ids, think, add_generation_prompt) -> list[int]:
    """`tok.chat_prompt_ids(messages, ...)`, from the ids of its first `head` messages where
    the template cuts after them."""
    settings = dict(think=think, add_generation_prompt=add_generation_prompt)
    if head and (ids := tok.chat_prompt_ids_after(messages, head, head_ids, **settings)):
        return ids
    return tok.chat_prompt_ids(messages, **settings)


def text_job(
    tok: Tokenizer,
    prompt: str | Sequence[int],
    *,
    params: SamplingParams,
    max_tokens: int,
    stop_strings: tuple[str, ...] = (),
    job_id: str | None = None,
) -> Job:
    """The Job of a raw prompt (`/v1/completions`): text as it is, special-token text included,
    after BOS where the tokenizer adds one; or token ids, checked against the vocabulary. Its
    boundary: `QUESTION_TAIL` tokens before its end (`tail`)."""
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_bos=tok.add_bos_token)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise BodyError(
                f"prompt token id {bad[0]} is out of range [0, {tok.vocab_size})", "prompt"
            )
    if not ids:
        raise BodyError("prompt has no tokens", "prompt")
    return Job(
        job_id or new_id("cmpl"),
        tuple(ids),
        params,
        max_tokens,
        frozenset(tok.eos_ids),
        stop_strings,
        tuple(tail(len(ids), ())),
        continues=True,
    )


@dataclass(frozen=True)
class Piece:
    """New text of the answer: `reasoning` (inside the leading <think> block) or `content`."""

    channel: str
    text: str


class AnswerText:
    """A job's tokens → the pieces of its answer to send, as they become certain.

    Text that may be the start of a stop string is held back until it cannot be; the answer
    never shows text from a stop string on. With `split_think` (chat), a leading
    <think>…</think> block is the reasoning and the text after it the content, both without
    their surrounding whitespace, exactly `salabatch.engine.chat.split_thinking` of the final
    text; reasoning pieces come only with `think` (else the block is dropped, as the Batch path
    drops it); without `strip` (a chat answer held to a pattern: its spaces are its text) the
    content keeps its whitespace but what follows `</think>`. Without `split_think` (a text
    completion) the text is the content, as it is: what it adds to the text of `after`, its
    prompt (`StreamingDetokenizer`).
    `logprobs`: the tokens' log-probabilities as added (None unless some were);
    `prompt_logprobs`: the prompt's, where its job scored it (`Job.prompt_logprobs`);
    `thinking.count`: the tokens of the think block (`ThinkingTokens`), whether sent or not.
    """

    def __init__(
        self,
        tok: Tokenizer,
        *,
        stop_strings: tuple[str, ...] = (),
        split_think: bool = True,
        strip: bool = True,
        think: bool = False,
        after: Sequence[int] = (),
    ) -> None:
        self._detok = tok.detokenizer(skip_special=True, after=after)
        self._stops = stop_strings
        self._split, self._strip, self._think = split_think, strip, think
        self._sent = {"reasoning": 0, "content": 0}
        self.reasoning = ""  # what was sent of each, so far
        self.content = ""
        self.logprobs: list[TokenLogprob] | None = None
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()
        self.thinking = ThinkingTokens()

    def add(self, token: int, logprob: TokenLogprob | None = None) -> list[Piece]:
        """The pieces token `token` makes certain (often none, or one); its `logprob` is
        kept."""
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        self._detok.add_token(token)
        if self._split:
            self.thinking.add(self._detok.text)
        return self._pieces(self._visible(self._detok.text), final=False)

    def finish(self, finished: Finished) -> list[Piece]:
        """The rest of the answer: the engine's text where a stop string ended it."""
        self._detok.finalize()
        text = finished.text if finished.text is not None else self._cut(self._detok.text)
        return self._pieces(text, final=True)

    def _cut(self, text: str) -> str:
        """`text` before the first stop string it holds."""
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return text[: min(found)] if found else text

    def _visible(self, text: str) -> str:
        """What of `text` is certain: before any stop string, and less a tail that may start
        one."""
        cut = self._cut(text)
        if len(cut) < len(text):
            return cut
        return text[: len(text) - max((_partial(text, s) for s in self._stops), default=0)]

    def _pieces(self, text: str, *, final: bool) -> list[Piece]:
        if not self._split:
            return self._send("content", text)
        reasoning, content = _split(text, final, self._strip)
        pieces = self._send("reasoning", reasoning) if self._think else []
        return pieces + self._send("content", content)

    def _send(self, channel: str, text: str) -> list[Piece]:
        sent = self._sent[channel]
        if len(text) <= sent:
            return []
        self._sent[channel] = len(text)
        setattr(self, channel, text)
        return [Piece(channel, text[sent:])]


def _split(text: str, final: bool, strip: bool = True) -> tuple[str, str]:
    """(reasoning, content) of the answer so far, as far as they are certain: each grows by
    appending only, and ends as `split_thinking(text, strip)` when `final`. Before the end, a
    text that may still open a think block shows nothing, the tail that may be the start of
    its `</think>` is held, and so is trailing whitespace (it is stripped if nothing follows;
    kept without `strip`)."""
    head = text.lstrip()
    if not final and THINK_OPEN.startswith(head):
        return "", ""  # nothing yet, or maybe the start of a think block
    if not head.startswith(THINK_OPEN):
        return "", head.rstrip() if strip else text
    body = head[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end >= 0:
        reasoning, content = body[:end].strip(), body[end + len(THINK_CLOSE) :].lstrip()
        return reasoning, content.rstrip() if strip else content
    if not final:
        body = body[: len(body) - _partial(body, THINK_CLOSE)]
    return body.strip(), ""


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (0: none)."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)
