"""The Python API, shaped like mlx-lm's: load a model once, then generate on it.

    import salabatch

    model, tokenizer = salabatch.load("builtin:tiny")
    text = salabatch.generate(model, tokenizer, "Say hi.", max_tokens=32)
    for response in salabatch.stream_generate(model, tokenizer, "Say hi."):
        print(response.text, end="", flush=True)
    answers = salabatch.batch_generate(model, tokenizer, document, ["Who?", "When?"])
    odds = salabatch.choose(model, tokenizer, document, ["Does it renew?"], ["yes", "no"])
    scores = salabatch.score(model, tokenizer, document)  # each token's log-probability

Speculative decoding is off unless asked for: `draft="lookup"` drafts from the prompt itself
(a document's own text), `"layers"` from the model's first `draft_layers` layers, `"auto"` picks
per row; `num_draft_tokens` tokens a step, as mlx-lm calls them. A greedy answer is the same
with it as without it.

A text prompt is one user message, put in the model's chat template (with `system` and `think`
as `salabatch generate` takes them); a list of token ids is used as it is. Answers are the text
as generated, special tokens left out: with `think=True` it starts with the `<think>` block
(`salabatch.engine.chat.split_thinking` splits it off).

The engine modules are imported inside the functions: they import mlx.core, which must come
after `activate_blas()` (see `salabatch.engine.blas`), and `load` calls it first. A loaded model
runs on any thread (one call at a time); a thread that ran MLX work should call
`mx.clear_streams()` before it ends, as MLX asks.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from salabatch.engine.blas import activate_blas
from salabatch.errors import GenerationError, TokenizerError

# positions reserved past a row's prompt when it joins (as the server's): its buffers grow with
# the answer from there, where reserving max_tokens (up to the whole context) cost that memory
# before the first token, even for an answer that stops at once
RESERVE_AHEAD = 1024

if TYPE_CHECKING:
    from salabatch.engine.grammar import Grammar
    from salabatch.engine.model import Model
    from salabatch.engine.sampling import SamplingParams, TokenLogprob
    from salabatch.engine.speculative import Speculation
    from salabatch.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationResponse:
    """One step of `stream_generate`, with the fields of mlx-lm's `GenerationResponse` (less
    `from_draft`; speculative decoding's counts instead). The last one has a `finish_reason`;
    when the model stops, its `token` is the stop token, which no text and no count includes.
    `logprobs`, with `stream_generate(..., logprobs=k)`: the token's log-probability and its k
    most likely alternatives (a `TokenLogprob`; mlx-lm's is the whole vocabulary's array),
    None for the stop token."""

    text: str  # the new piece of text; may be empty (a character still incomplete)
    token: int  # the token just generated
    prompt_tokens: int
    prompt_tps: float  # prompt tokens per second, up to the first token
    generation_tokens: int  # tokens of the answer so far
    generation_tps: float  # answer tokens per second after the first (0.0 until the second)
    peak_memory: float  # GB of 10^9 bytes (as mlx-lm's), MLX's peak so far
    finish_reason: str | None = None  # "stop" | "length" on the last response
    draft_tokens: int = 0  # tokens drafted so far (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted
    logprobs: TokenLogprob | None = None


def load(
    path_or_ref: str | os.PathLike,
    dtype: str | None = None,
    *,
    cache_dir: str | Path | None = None,
) -> tuple[Model, Tokenizer]:
    """(model, tokenizer) of a checkpoint folder, `builtin:tiny` or a Hugging Face repo id
    (see `salabatch.models`); `dtype` None / "auto": float32 on CPU, bfloat16 on a GPU;
    `cache_dir` holds builtin models (default: the salabatch cache)."""
    activate_blas()  # before the engine's first import of mlx.core
    from salabatch.engine.load import load_model
    from salabatch.engine.tokenizer import load_tokenizer
    from salabatch.models import resolve_model

    if not isinstance(path_or_ref, str | os.PathLike):
        raise GenerationError(
            f"must be a checkpoint folder or a model reference, got {_shown(path_or_ref)}",
            field="path_or_ref",
        )
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise GenerationError(f"must be a folder, got {_shown(cache_dir)}", field="cache_dir")
    path = resolve_model(path_or_ref, cache_dir)
    tok = load_tokenizer(path)
    return load_model(path, dtype=dtype, tokens=tok.vocab_size), tok


def stream_generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    max_tokens: int = 256,
    *,
    system: str | None = None,
    think: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int = 0,
    prefill_chunk: int = 2048,
    draft: str = "off",
    num_draft_tokens: int = 4,
    draft_layers: int = 8,
    logprobs: int | None = None,
    json_schema: dict | None = None,
    choices: Sequence[str] | None = None,
    logit_bias: dict[int, float] | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Iterator[GenerationResponse]:
    """Yields one GenerationResponse per token of the answer to `prompt`, until a stop token of
    the tokenizer or `max_tokens` (cut where the model's context ends; a prompt that fills it
    is a GenerationError). Greedy unless `temperature` > 0; the same seed gives the same text,
    as in `salabatch run`. `repetition_penalty` counts the answer's tokens, not the prompt's
    (HF and mlx-lm count both). `draft`, `num_draft_tokens`, `draft_layers`: speculative
    decoding (see the module docstring); `logprobs=k` (0 to 20): each response's `logprobs`
    (drafting then pauses); `json_schema` (JSON it validates) or `choices` (one of these
    strings): what the answer must be (no drafts either); `logit_bias` {token id: bias in
    [-100, 100]}: added to those tokens' logits (no drafts either);
    `prompt_progress_callback(done, total)`: called after each prefill chunk, as mlx-lm's (the
    last call has done == total). Bad arguments are GenerationErrors naming them; a prompt
    that needs more memory than is free, an OutOfMemoryError before its prefill (each step
    runs within MLX's memory limit at the plan, `memory.bounded`)."""
    from salabatch.engine import memory
    from salabatch.engine.generate import Generator, Request, answer_room
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime
    from salabatch.engine.sampling import TOP_LOGPROBS

    _counts(max_tokens=max_tokens, prefill_chunk=prefill_chunk)
    speculation = _speculation(draft, num_draft_tokens, draft_layers)
    _flags(think=think)
    if prompt_progress_callback is not None and not callable(prompt_progress_callback):
        raise GenerationError(
            f"must be callable, got {_shown(prompt_progress_callback)}",
            field="prompt_progress_callback",
        )
    ids = _prompt_ids(model, tokenizer, prompt, system=system, think=think)
    params = _params(temperature, top_p, top_k, min_p, repetition_penalty, seed, logit_bias)
    _vocab_ids(model, logit_bias)
    max_tokens = answer_room(model.config, len(ids), max_tokens)  # the server's rule
    if logprobs is not None and (
        isinstance(logprobs, bool)
        or not isinstance(logprobs, numbers.Integral)
        or not 0 <= logprobs <= TOP_LOGPROBS
    ):
        raise GenerationError(
            f"must be None or an integer in [0, {TOP_LOGPROBS}], got {logprobs!r}", field="logprobs"
        )
    eos = frozenset(tokenizer.eos_ids)
    grammar = _grammar(tokenizer, json_schema, choices)
    request = Request("0", tuple(ids), params, max_tokens, eos, logprobs=logprobs, grammar=grammar)
    detok = tokenizer.detokenizer(skip_special=True)
    # no context: the prompt is all the row has, and the lookup drafter searches it
    generator = Generator(
        model,
        batch_size=1,
        prefill_chunk=prefill_chunk,
        speculation=speculation,
        reserve_ahead=RESERVE_AHEAD,
        on_prefill=prompt_progress_callback and _progress(prompt_progress_callback),
    )
    # as `salabatch run` answers a pooled row: refused before its prefill where it cannot fit
    needs = memory.model_plan(
        model, doc_tokens=0, rows=[len(ids) + max_tokens], chunk=prefill_chunk, batch_size=1
    )
    memory.check(needs, advice="lower prefill_chunk or max_tokens, or free memory")
    limit = cache_limit(model.config, prefill_chunk, on_gpu())
    steps = generator.stream([request])
    first_at = None
    while True:
        # The process settings are the engine's only while a step runs, the caller's between
        # yields: held across them, two streams consumed in turn restored each other's.
        with engine_runtime(limit), memory.bounded(needs):
            g = next(steps, None)
        if g is None:
            return
        now = time.perf_counter()
        first_at = first_at or now
        # a step may read several tokens (accepted drafts): one response for each, and the
        # stop token, when it ended the answer, one of its own (no text), the last
        new = g.tokens[len(detok.tokens) :]
        stopped = g.done and g.last_token in request.stop
        for i, token in enumerate(new):
            detok.add_token(token)
            last = i == len(new) - 1 and not stopped
            if last and g.done:
                detok.finalize()
            lp = g.logprobs[len(detok.tokens) - 1] if logprobs is not None else None
            yield _response(detok, token, ids, g, len(detok.tokens), now, first_at, last, lp)
        if stopped:
            detok.finalize()
            yield _response(detok, g.last_token, ids, g, len(g.tokens), now, first_at, True)


def _progress(callback: Callable[[int, int], None]) -> Callable[[object, int, int], None]:
    """A Generator's `on_prefill` calling mlx-lm's `prompt_progress_callback(done, total)`."""
    return lambda _request, done, total: callback(done, total)


def _response(detok, token, ids, g, n, now, first_at, last, lp=None) -> GenerationResponse:
    """`stream_generate`'s response for the answer's n-th token (`last`: the step's last)."""
    import mlx.core as mx

    return GenerationResponse(
        text=detok.last_segment,
        token=token,
        prompt_tokens=len(ids),
        prompt_tps=len(ids) / g.ttft_s if g.ttft_s else 0.0,
        generation_tokens=n,
        generation_tps=(n - 1) / (now - first_at) if n > 1 and now > first_at else 0.0,
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=g.finish_reason if last else None,
        draft_tokens=g.draft_tokens,
        accepted_tokens=g.accepted_tokens,
        logprobs=lp,
    )


def generate(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    verbose: bool = False,
    **settings,
) -> str:
    """The whole answer to `prompt` (`settings`: those of `stream_generate`, `max_tokens`
    included). `verbose` prints it as it comes, then the token counts and speeds."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, **settings):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print()
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {last.generation_tokens} tokens, "
            f"{last.generation_tps:.3f} tokens-per-sec ({last.finish_reason})"
        )
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return text


def batch_generate(
    model: Model,
    tokenizer: Tokenizer,
    document: str,
    questions: Sequence[str],
    max_tokens: int = 256,
    *,
    system: str | None = None,
    think: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    prefill_chunk: int = 2048,
    draft: str = "off",
    num_draft_tokens: int = 4,
    draft_layers: int = 8,
    json_schema: dict | None = None,
    choices: Sequence[str] | None = None,
    logit_bias: dict[int, float] | None = None,
) -> list[str]:
    """The answers to `questions` about `document`, in question order. The document's prompt
    is prefilled once and every question continues it, up to `batch_size` decoding together;
    each prompt is the one `salabatch run` builds (document, then question, one user message).
    `draft`, `num_draft_tokens`, `draft_layers`: speculative decoding (the module docstring);
    the lookup drafter searches the document. `json_schema` or `choices`: what every answer
    must be, as `stream_generate`'s. Planned as `salabatch run` plans a document: an
    OutOfMemoryError before the prefill where it cannot fit, else run within its plan."""
    from salabatch.engine import memory
    from salabatch.engine.generate import Generator, Request, answer_room, prefill
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime

    _counts(max_tokens=max_tokens, prefill_chunk=prefill_chunk, batch_size=batch_size)
    if not isinstance(document, str):
        raise GenerationError(f"must be a text, got {_shown(document)}", field="document")
    if (
        isinstance(questions, str)
        or not isinstance(questions, Sequence)
        or not all(isinstance(q, str) for q in questions)
    ):
        raise GenerationError(
            "must be a list of strings (one question: [question])", field="questions"
        )
    _flags(think=think)
    _text_or_none(system=system)
    speculation = _speculation(draft, num_draft_tokens, draft_layers)
    params = _params(temperature, top_p, top_k, min_p, repetition_penalty, seed, logit_bias)
    _vocab_ids(model, logit_bias)
    stop = frozenset(tokenizer.eos_ids)
    grammar = _grammar(tokenizer, json_schema, choices)
    if not questions:
        return []
    try:
        doc_prompt = tokenizer.document_prompt(document, system=system, think=think)
    except TokenizerError as e:  # a document of only whitespace
        raise GenerationError(e.message, field="document") from None
    context = tuple(doc_prompt)  # one tuple for every row: what the lookup drafter searches
    # the server's rule, before any prefill: each row's prompt is the document and its question
    answer_room(model.config, len(doc_prompt), max_tokens, field="document")
    requests = []
    for i, q in enumerate(questions):
        suffix = tuple(tokenizer.prompt_suffix(q, system=system, think=think))
        n = len(doc_prompt) + len(suffix)
        room = answer_room(model.config, n, max_tokens, field=f"questions[{i}]")
        requests.append(
            Request(str(i), suffix, params, room, stop, context=context, grammar=grammar)
        )
    # a document below dense_len whose prompts reach it: each row from its whole prompt, as
    # `salabatch run` pools it (a prefix prefilled alone would run the sparse layers dense)
    longest = len(doc_prompt) + max(len(r.prompt) for r in requests)
    whole = model.config.splits_modes(len(doc_prompt), longest)
    if whole:
        requests = [replace(r, prompt=(*doc_prompt, *r.prompt), context=()) for r in requests]
    # as `salabatch run` answers a document: refused before its prefill where it cannot fit
    rows = [len(r.prompt) + r.max_tokens for r in requests]
    doc_tokens = 0 if whole else len(doc_prompt)
    needs = memory.model_plan(
        model, doc_tokens=doc_tokens, rows=rows, chunk=prefill_chunk, batch_size=batch_size
    )
    memory.check(needs, advice="lower prefill_chunk, batch_size or max_tokens, or free memory")
    with engine_runtime(cache_limit(model.config, prefill_chunk, on_gpu())), memory.bounded(needs):
        prefix = None if whole else model.make_cache()
        if prefix is not None:
            prefill(model, doc_prompt, prefix, prefill_chunk)
        generator = Generator(
            model,
            batch_size=batch_size,
            prefill_chunk=prefill_chunk,
            speculation=speculation,
            reserve_ahead=RESERVE_AHEAD,
        )
        done = {g.request.id: g.tokens for g in generator.generate(requests, prefix)}
    return [_streamed_text(tokenizer, done[r.id]) for r in requests]


def _streamed_text(tokenizer: Tokenizer, tokens: Sequence[int]) -> str:
    """An answer's text as `generate` streams it (and `salabatch run` writes it): where byte
    tokens make no character, a stream keeps the characters before them that a whole decode
    would turn to U+FFFD with them."""
    detok = tokenizer.detokenizer(skip_special=True)
    for token in tokens:
        detok.add_token(token)
    detok.finalize()
    return detok.text


def choose(
    model: Model,
    tokenizer: Tokenizer,
    document: str,
    questions: Sequence[str],
    choices: Sequence[str],
    *,
    system: str | None = None,
    batch_size: int = 8,
    prefill_chunk: int = 2048,
) -> list[dict[str, float]]:
    """Each of `questions` about `document` answered among `choices`, as `salabatch run`
    answers a choices question: every choice scored as the whole answer (its tokens then the
    end-of-turn token) after the question's prompt (`engine.choose`), → per question, each
    choice's probability among them, in the choices' order (the likeliest is the answer). The
    document is prefilled once; `batch_size` rows to a call. A choice the vocabulary cannot
    spell alone is a GenerationError naming it (`batch_generate(..., choices=)` decodes under
    the choices' pattern instead)."""
    from salabatch.engine import memory
    from salabatch.engine.choose import choice_scores, probabilities, spelled_choices
    from salabatch.engine.generate import answer_room, prefill
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime

    _counts(prefill_chunk=prefill_chunk, batch_size=batch_size)
    if not isinstance(document, str):
        raise GenerationError(f"must be a text, got {_shown(document)}", field="document")
    for name, texts in (("questions", questions), ("choices", choices)):
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise GenerationError(f"must be a list of strings, got {_shown(texts)}", field=name)
        if not all(isinstance(t, str) and t for t in texts):
            raise GenerationError("must hold non-empty strings only", field=name)
    if not choices:
        raise GenerationError("must hold at least one choice", field="choices")
    if len(set(choices)) < len(choices):
        raise GenerationError("must not hold a choice twice", field="choices")
    _text_or_none(system=system)
    spelled = spelled_choices(tokenizer, choices)
    if not questions:
        return []
    try:
        doc_prompt = tokenizer.document_prompt(document, system=system, think=False)
    except TokenizerError as e:  # a document of only whitespace
        raise GenerationError(e.message, field="document") from None
    heads = [tokenizer.prompt_suffix(q, system=system, think=False) for q in questions]
    longest = max(len(h) for h in heads) + max(len(c) for c in spelled)
    answer_room(model.config, len(doc_prompt) + longest - 1, 1, field="document")
    needs = memory.model_plan(
        model,
        doc_tokens=len(doc_prompt),
        rows=[longest] * len(heads),  # scored batch_size questions to a call
        chunk=prefill_chunk,
        batch_size=batch_size,
    )
    memory.check(needs, advice="lower prefill_chunk or batch_size, or free memory")
    # a document below dense_len that a question's prompt takes past it: that question's prefix
    # is prefilled as its prompt's one call runs it, InfLLM-v2 (alone it would run dense, SPEC
    # P7); the questions on each side of dense_len from their own prefix
    reach = [len(doc_prompt) + len(head) + 1 for head in heads]
    crossing = [model.config.splits_modes(len(doc_prompt), n) for n in reach]
    scores: list = [None] * len(heads)
    with engine_runtime(cache_limit(model.config, prefill_chunk, on_gpu())), memory.bounded(needs):
        for crosses in (False, True):
            side = [i for i, c in enumerate(crossing) if c == crosses]
            if not side:
                continue
            prefix = model.make_cache()  # the other side's was let go
            planned = min(reach[i] for i in side) if crosses else None
            prefill(model, doc_prompt, prefix, prefill_chunk, planned=planned)
            asks = [(heads[i], spelled) for i in side]
            got = choice_scores(model, prefix, asks, rows=batch_size, chunk=prefill_chunk)
            for i, per_choice in zip(side, got, strict=True):
                scores[i] = per_choice
            del prefix
    out = []
    for per_choice in scores:
        chances = probabilities([sum(x.logprob for x in s) for s in per_choice])
        out.append(dict(zip(choices, chances, strict=True)))
    return out


def score(
    model: Model,
    tokenizer: Tokenizer,
    text: str | Sequence[int],
    *,
    logprobs: int = 0,
    prefill_chunk: int = 2048,
    progress: Callable[[int, int], None] | None = None,
) -> list[TokenLogprob]:
    """Each token of `text` after the first, scored by the model given the tokens before it:
    its log-probability, with its `logprobs` (0 to 20) most likely alternatives'. The mean of
    the negated log-probabilities is the text's negative log-likelihood per token, its exp the
    perplexity (`salabatch perplexity`). A text is scored as it is, no chat template (after the
    tokenizer's BOS, where it adds one), special-token text as its control token (as a prompt;
    `perplexity` reads a document's as text, as `run` does: give its ids); token ids as they
    are. The text is prefilled once in
    chunks of `prefill_chunk`, `progress(done, total)` after each; one longer than the model's
    context, or needing more memory than is free, is refused before any work."""
    from salabatch.engine import memory
    from salabatch.engine.generate import Prefill
    from salabatch.engine.kernels.attention import on_gpu
    from salabatch.engine.memory import cache_limit
    from salabatch.engine.runtime import engine_runtime
    from salabatch.engine.sampling import TOP_LOGPROBS

    _counts(prefill_chunk=prefill_chunk)
    if (
        isinstance(logprobs, bool)
        or not isinstance(logprobs, numbers.Integral)
        or not (0 <= logprobs <= TOP_LOGPROBS)
    ):
        raise GenerationError(
            f"must be an integer in [0, {TOP_LOGPROBS}], got {logprobs!r}", field="logprobs"
        )
    if progress is not None and not callable(progress):
        raise GenerationError(f"must be callable, got {_shown(progress)}", field="progress")
    if isinstance(text, str):
        ids = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
        if not ids:
            raise GenerationError("the text has no tokens", field="text")
    else:
        ids = _prompt_ids(model, tokenizer, text, field="text")
    context = model.config.context_length
    if len(ids) > context:
        raise GenerationError(
            f"the text has {len(ids)} tokens, the model's context holds {context}", field="text"
        )
    chunk = min(prefill_chunk, len(ids))
    needs = memory.model_plan(model, doc_tokens=0, rows=[len(ids)], chunk=chunk, batch_size=1)
    needs = replace(needs, transient=needs.transient + memory.score_bytes(model.config, chunk))
    memory.check(needs, advice="lower prefill_chunk, or free memory")
    with engine_runtime(cache_limit(model.config, prefill_chunk, on_gpu())), memory.bounded(needs):
        feed = Prefill(model, ids, model.make_cache(), prefill_chunk, score=int(logprobs))
        while not feed.finished:
            done = feed.step()
            if progress is not None:
                progress(done, len(ids))
        return feed.scores()


def _prompt_ids(
    model: Model,
    tokenizer: Tokenizer,
    prompt: str | Sequence[int],
    *,
    system: str | None = None,
    think: bool = False,
    field: str = "prompt",
) -> list[int]:
    """The token ids of a prompt: a text is one user message in the chat template (after
    `system`, if given); token ids (a list, or a 1-D array, of integers) are checked against
    the model's vocabulary. GenerationError naming `field` (the caller's argument) for
    anything else (bytes, floats, None, a 2-D array, no ids, ids past the vocabulary), where
    `int()` would have taken bytes and floats silently."""

    _text_or_none(system=system)
    if isinstance(prompt, str):
        system_message = [{"role": "system", "content": system}] if system else []
        messages = [*system_message, {"role": "user", "content": prompt}]
        return tokenizer.chat_prompt_ids(messages, think=think)
    expected = "a text or a list of token ids (integers)"
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # an MLX or NumPy array
        if prompt.ndim != 1:
            shape = tuple(prompt.shape)
            raise GenerationError(f"must be {expected}, got an array of shape {shape}", field=field)
        prompt = prompt.tolist()
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Sequence):
        raise GenerationError(f"must be {expected}, got {_shown(prompt)}", field=field)
    odd = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if odd:
        raise GenerationError(f"must be {expected}, got the item {odd[0]!r}", field=field)
    if system is not None:
        raise GenerationError(
            "a system prompt needs a text prompt; token ids are used as they are", field="system"
        )
    ids = [int(t) for t in prompt]
    vocab = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if not ids or bad:
        raise GenerationError(
            "token ids out of range" if bad else "the prompt has no tokens",
            field=field,
            expected=f"ids in [0, {vocab})",
            got=bad[0] if bad else [],
        )
    return ids


def _counts(**counts: int) -> None:
    """GenerationError naming the first of `counts` that is not an integer ≥ 1."""

    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise GenerationError(f"must be an integer ≥ 1, got {value!r}", field=name)


def _text_or_none(**texts: object) -> None:
    """GenerationError naming the first of `texts` that is neither a string nor None."""

    for name, value in texts.items():
        if value is not None and not isinstance(value, str):
            raise GenerationError(f"must be a text or None, got {_shown(value)}", field=name)


def _shown(value: object) -> str:
    """A wrong argument for an error message: its type, and its value when short."""
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def _grammar(tokenizer: Tokenizer, json_schema, choices) -> Grammar | None:
    """The grammar of a `json_schema` or of `choices` (GenerationErrors naming them)."""
    from salabatch.structure import choice_pattern, schema_pattern

    if json_schema is not None and choices is not None:
        raise GenerationError("give json_schema or choices, not both", field="choices")
    if json_schema is not None:
        if not isinstance(json_schema, dict):
            raise GenerationError(f"must be a dict, got {_shown(json_schema)}", field="json_schema")
        try:
            pattern = schema_pattern(json_schema)
        except ValueError as e:
            raise GenerationError(str(e), field="json_schema") from None
    elif choices is not None:
        if (
            isinstance(choices, str)
            or not isinstance(choices, Sequence)  # an iterator: the check would use it up
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise GenerationError(
                f"must be a list of non-empty strings, got {_shown(choices)}", field="choices"
            )
        pattern = choice_pattern(choices)
    else:
        return None
    return tokenizer.grammars.regex(pattern, field="json_schema" if json_schema else "choices")


def _speculation(draft: str, tokens: int, layers: int) -> Speculation:
    """The engine's Speculation of the API's arguments (ValueError naming a bad one)."""
    from salabatch.engine.speculative import Speculation

    _counts(num_draft_tokens=tokens, draft_layers=layers)
    try:
        return Speculation(draft, tokens, layers)  # it names the drafts allowed
    except ValueError as e:
        raise GenerationError(str(e), field="draft") from None


def _flags(**flags) -> None:
    """GenerationError naming an argument that must be True or False (a string such as "no"
    would be taken as true)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise GenerationError(f"must be True or False, got {_shown(value)}", field=name)


def _vocab_ids(model: Model, logit_bias: dict[int, float] | None) -> None:
    """GenerationError naming logit_bias where it names a token past the model's vocabulary."""
    vocab = model.config.vocab_size
    if logit_bias and (far := [t for t in logit_bias if not 0 <= t < vocab]):
        raise GenerationError(
            f"token {far[0]} is not in the vocabulary [0, {vocab})", field="logit_bias"
        )


def _params(
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repetition_penalty: float,
    seed: int,
    logit_bias: dict[int, float] | None = None,
) -> SamplingParams:
    """The sampling settings; `logit_bias` {token id: bias in [-100, 100]} as (id, bias) pairs
    (a GenerationError naming it where it is not such a mapping)."""
    from salabatch.engine.sampling import SamplingParams

    ids = logit_bias.keys() if isinstance(logit_bias, dict) else ()
    if logit_bias is not None and not (
        isinstance(logit_bias, dict)
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids)
    ):
        raise GenerationError(
            f"must be a dict of token id → bias, got {_shown(logit_bias)}", field="logit_bias"
        )
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        logit_bias=tuple(sorted((logit_bias or {}).items())),
    )
