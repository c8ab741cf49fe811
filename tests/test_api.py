"""The Python API (`salabatch.load / generate / stream_generate / batch_generate`) on builtin:random
(an untrained test model): it generates what the engine generates, on a model loaded once, from
any thread; `import salabatch` stays light and `load` activates the BLAS before MLX."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import salabatch
from salabatch.engine import generate as generate_module
from salabatch.engine.cache import ModelCache
from salabatch.engine.generate import Generator, Request
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.speculative import OFF, Speculation
from salabatch.errors import GenerationError
from tests.drafts import record_generators
from tests.engine.test_threads import on_thread

DOC = "The ferry to Eastwick leaves at 7:10 from the north quay. " * 12
QUESTIONS = ["When does it leave?", "Where to?", "Why?", "Who runs the ferry to Eastwick?"]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def loaded(cache_dir):
    return salabatch.load("builtin:random", cache_dir=cache_dir)


def engine_tokens(model, tok, ids, max_tokens, params=GREEDY) -> list[int]:
    request = Request("r", tuple(ids), params, max_tokens, frozenset(tok.eos_ids))
    (g,) = Generator(model, batch_size=1).generate([request])
    return g.tokens


def user_ids(tok, text: str) -> list[int]:
    return tok.chat_prompt_ids([{"role": "user", "content": text}], think=False)


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7}]
)
def test_generates_what_the_engine_generates(loaded, sampling):
    model, tok = loaded
    responses = list(salabatch.stream_generate(model, tok, "Say hi.", 12, **sampling))
    tokens = [r.token for r in responses if r.finish_reason != "stop"]
    assert tokens == engine_tokens(
        model, tok, user_ids(tok, "Say hi."), 12, SamplingParams(**sampling)
    )
    text = salabatch.generate(model, tok, "Say hi.", max_tokens=12, **sampling)
    assert text == "".join(r.text for r in responses) == tok.decode(tokens, skip_special=True)


def test_stream_responses_count_and_finish(loaded):
    model, tok = loaded
    responses = list(salabatch.stream_generate(model, tok, "Say hi.", max_tokens=5))
    assert [r.generation_tokens for r in responses] == [1, 2, 3, 4, 5]
    assert [r.finish_reason for r in responses] == [None] * 4 + ["length"]
    first, last = responses[0], responses[-1]
    assert first.prompt_tokens == len(user_ids(tok, "Say hi.")) and first.prompt_tps > 0
    assert first.generation_tps == 0 and last.generation_tps > 0 and last.peak_memory > 0

    # A stop token ends the answer: the last response carries it, no text and no count.
    tokens = engine_tokens(model, tok, user_ids(tok, "Say hi."), 3)
    n = tokens.index(tokens[2])  # the answer's tokens before the first of it
    stopping = copy.copy(tok)
    stopping.eos_ids = tok.eos_ids | {tokens[2]}
    responses = list(salabatch.stream_generate(model, stopping, "Say hi.", max_tokens=5))
    assert [r.finish_reason for r in responses] == [None] * n + ["stop"]
    assert responses[-1].token == tokens[2] and responses[-1].generation_tokens == n
    assert "".join(r.text for r in responses) == tok.decode(tokens[:n], skip_special=True)

    # Speculating, a step reads several tokens: still one response per token, the same text.
    for draft in ("layers", "lookup"):
        drafted = list(salabatch.stream_generate(model, tok, "Say hi.", 12, draft=draft))
        plain = list(salabatch.stream_generate(model, tok, "Say hi.", 12))
        assert [r.token for r in drafted] == [r.token for r in plain]
        assert [r.generation_tokens for r in drafted] == list(range(1, 13))
        assert "".join(r.text for r in drafted) == "".join(r.text for r in plain)


def test_prompt_progress_is_reported_chunk_by_chunk_before_the_first_token(loaded):
    """mlx-lm's `prompt_progress_callback(done, total)`: after each prefill chunk, the last at
    done == total, all before the answer's first token; the answer is the same as without."""
    model, tok = loaded
    calls, seen_by_first = [], []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))

    prompt = DOC * 2
    total = len(user_ids(tok, prompt))
    responses = []
    for r in salabatch.stream_generate(
        model, tok, prompt, 4, prefill_chunk=64, prompt_progress_callback=progress
    ):
        seen_by_first = seen_by_first or list(calls)
        responses.append(r)
    assert seen_by_first == calls  # every chunk reported before the first token
    assert calls == [(min(n, total), total) for n in range(64, total + 64, 64)]
    plain = salabatch.stream_generate(model, tok, prompt, 4, prefill_chunk=64)
    assert [r.token for r in responses] == [r.token for r in plain]


def test_stream_logprobs_are_each_tokens_with_its_alternatives(loaded):
    """Asking changes no token; greedy, each token is the first of its k alternatives; a stop
    token's response has none; a bad k is refused by name."""
    model, tok = loaded
    plain = list(salabatch.stream_generate(model, tok, "Say hi.", 6))
    asked = list(salabatch.stream_generate(model, tok, "Say hi.", 6, logprobs=3))
    assert [r.token for r in asked] == [r.token for r in plain]
    assert all(r.logprobs is None for r in plain)
    for r in asked:
        lp = r.logprobs
        assert lp.token == r.token and len(lp.top) == 3 and lp.top[0] == (lp.token, lp.logprob)
    tokens = engine_tokens(model, tok, user_ids(tok, "Say hi."), 3)
    stopping = copy.copy(tok)
    stopping.eos_ids = tok.eos_ids | {tokens[2]}
    stopped = list(salabatch.stream_generate(model, stopping, "Say hi.", 5, logprobs=0))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].logprobs is None
    assert all(r.logprobs.top == () for r in stopped[:-1])
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(ValueError, match="logprobs"):
            list(salabatch.stream_generate(model, tok, "Say hi.", 2, logprobs=bad))


def test_token_ids_are_used_as_they_are(loaded):
    model, tok = loaded
    ids = tok.chat_prompt_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        think=False,
    )
    by_text = salabatch.generate(model, tok, "Say hi.", system="Be brief.", max_tokens=6)
    assert salabatch.generate(model, tok, ids, max_tokens=6) == by_text
    with pytest.raises(GenerationError, match="out of range") as e:
        salabatch.generate(model, tok, [5, model.config.vocab_size])
    assert e.value.field == "prompt"
    with pytest.raises(GenerationError, match="no tokens"):
        salabatch.generate(model, tok, [])
    with pytest.raises(GenerationError, match="system prompt needs a text prompt"):
        salabatch.generate(model, tok, ids, system="Be brief.")


def test_batch_generate_answers_in_question_order(loaded):
    model, tok = loaded
    got = salabatch.batch_generate(model, tok, DOC, QUESTIONS, max_tokens=8, batch_size=3)
    # Each alone, from its whole prompt (no shared prefix): the document and the question in
    # one user message, as `salabatch run` asks it.
    alone = [
        salabatch.generate(model, tok, f"{DOC.strip()}\n\n{q}", max_tokens=8) for q in QUESTIONS
    ]
    assert got == alone and len(set(alone)) > 1
    assert salabatch.batch_generate(model, tok, DOC, []) == []


def test_batch_generate_gives_an_answers_text_as_generate_streams_it(loaded, tmp_path, monkeypatch):
    """Byte tokens that make no character after a whole one: a SentencePiece-style tokenizer's
    decode turns the character to U+FFFD with them, a stream has given it already. Each answer
    of batch_generate is the streamed text, as generate and `salabatch run` give it."""
    from types import SimpleNamespace

    from salabatch.engine.tokenizer import load_tokenizer
    from tests.engine.test_tokenizer import sentencepiece_style_dir

    model, _ = loaded
    sp = load_tokenizer(sentencepiece_style_dir(tmp_path / "sp"))
    answer = [sp.token_id(f"<0x{b:02X}>") for b in "日".encode() + b"\x80"] + [sp.token_id("a")]

    def stream(self, requests, prefix=None):
        for r in requests:
            yield SimpleNamespace(request=r, tokens=list(answer), done=True)

    monkeypatch.setattr(Generator, "stream", stream)
    (got,) = salabatch.batch_generate(model, sp, "A document.", ["Which?"], max_tokens=4)
    detok = sp.detokenizer(skip_special=True)
    for token in answer:
        detok.add_token(token)
    assert got == detok.text and got.startswith("日") and got.endswith("\ufffda")
    assert sp.decode(answer, skip_special=True) != got  # the whole decode: no 日


def test_numpy_numbers_are_taken_as_python_ones(loaded):
    """A sweep over `np.linspace` temperatures, NumPy seeds and top-k: the same answers as the
    Python numbers give (MLX refused them deep in the decode loop, and an int64 seed overflowed
    in the seeds' mixing)."""
    import numpy as np

    model, tok = loaded
    python = {"temperature": 0.5, "seed": 3, "top_k": 5, "repetition_penalty": 1.1}
    numpy = {
        "temperature": np.linspace(0, 1, 3)[1],
        "seed": np.int64(3),
        "top_k": np.int32(5),
        "repetition_penalty": np.float32(1.1),
    }
    want = salabatch.generate(model, tok, "Say hi.", max_tokens=8, **python)
    got = salabatch.generate(model, tok, "Say hi.", max_tokens=8, **numpy)
    assert got == want
    got = salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], max_tokens=4, **numpy)
    assert got == salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], max_tokens=4, **python)
    params = SamplingParams(**numpy, logit_bias=((np.int64(5), np.float32(2.0)),))
    assert all(type(getattr(params, k)) is type(v) for k, v in python.items())
    assert params.logit_bias == ((5, 2.0),) and type(params.logit_bias[0][0]) is int


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": 2.5}, "top_k"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ],
)
def test_bad_settings_are_refused_by_name_before_any_work(loaded, settings, named):
    model, tok = loaded
    for call in (
        lambda: salabatch.generate(model, tok, "Hi.", **settings),
        lambda: salabatch.batch_generate(model, tok, DOC, QUESTIONS[:1], **settings),
    ):
        with pytest.raises(ValueError, match=named):
            call()


def test_a_document_below_dense_len_its_questions_reach_answers_as_one_call(loaded):
    """A document prompt just under dense_len whose questions take it past: prefilled alone it
    ran the sparse layers dense, one call over a question's whole prompt runs them InfLLM-v2
    (SPEC P7): answers differed from `generate` on the same ids. Each question now answers
    from its whole prompt."""
    model, tok = loaded
    sc = model.config.sparse
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "lamp", "quiet", "north", "seven"]
    doc = " ".join(np.random.default_rng(0).choice(words, 3000))
    while len(tok.document_prompt(doc, system=None, think=False)) > sc.dense_len - 20:
        doc = doc[: int(len(doc) * 0.98)].rsplit(" ", 1)[0]
    questions = [
        "Which word comes most often in the text above, and how many times does it come?",
        "Name it.",
    ]
    doc_ids = tok.document_prompt(doc, system=None, think=False)
    assert sc.topk_eff * sc.block_size < len(doc_ids) < sc.dense_len
    got = salabatch.batch_generate(model, tok, doc, questions, max_tokens=8)
    wholes = [doc_ids + tok.prompt_suffix(q, system=None, think=False) for q in questions]
    assert len(wholes[0]) >= sc.dense_len  # the first reaches it (the second, shorter, not)
    for ids, answer in zip(wholes, got, strict=True):
        assert answer == tok.decode(engine_tokens(model, tok, ids, 8), skip_special=True)


def test_batch_generate_takes_a_list_of_questions_and_a_batch_size(loaded):
    model, tok = loaded
    with pytest.raises(ValueError, match="questions: must be a list"):
        salabatch.batch_generate(model, tok, DOC, "When does it leave?")
    with pytest.raises(ValueError, match="batch_size"):
        salabatch.batch_generate(model, tok, DOC, QUESTIONS, batch_size=0)


def test_speculation_reaches_the_generator_and_its_counts_come_back(loaded, monkeypatch):
    model, tok = loaded
    seen = record_generators(monkeypatch, generate_module)
    plain = salabatch.generate(model, tok, "Say hi.", max_tokens=6)
    assert seen.speculations == [OFF]  # off unless asked for
    settings = {"draft": "lookup", "num_draft_tokens": 3, "draft_layers": 2}
    responses = list(salabatch.stream_generate(model, tok, "Say hi.", 6, **settings))
    assert seen.speculations[-1] == Speculation("lookup", 3, 2)
    assert seen.requests[-1].context == ()  # the prompt is all there is to search
    n = responses[-1].generation_tokens
    assert (responses[-1].draft_tokens, responses[-1].accepted_tokens) == (2 * n + 1, n)
    assert "".join(r.text for r in responses) == plain  # greedy: the same answer

    answers = salabatch.batch_generate(
        model, tok, DOC, QUESTIONS[:2], 4, draft="auto", num_draft_tokens=2
    )
    assert seen.speculations[-1] == Speculation("auto", 2, 8)
    first, second = seen.requests[-2:]
    doc_prompt = tuple(tok.document_prompt(DOC, system=None, think=False))
    assert first.context == doc_prompt and second.context is first.context
    assert answers == salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], 4)

    for bad, message in (
        ({"draft": "medusa"}, "draft must be one of off, lookup, layers, auto"),
        ({"draft": "layers", "num_draft_tokens": 0}, "num_draft_tokens: must be an integer ≥ 1"),
        ({"draft": "layers", "draft_layers": 2.5}, "draft_layers: must be an integer ≥ 1"),
    ):
        with pytest.raises(ValueError, match=message):
            salabatch.generate(model, tok, "Say hi.", max_tokens=2, **bad)
        with pytest.raises(ValueError, match=message):
            salabatch.batch_generate(model, tok, DOC, QUESTIONS[:1], 2, **bad)


def test_load_on_one_thread_generate_on_another(cache_dir, loaded):
    model, tok = on_thread(lambda: salabatch.load("builtin:random", cache_dir=cache_dir))
    text = on_thread(lambda: salabatch.generate(model, tok, "Say hi.", max_tokens=8))
    assert text == salabatch.generate(*loaded, "Say hi.", max_tokens=8)
    answers = on_thread(lambda: salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], 4))
    assert answers == salabatch.batch_generate(*loaded, DOC, QUESTIONS[:2], 4)


def test_import_is_light_and_load_activates_the_blas_first(cache_dir):
    code = textwrap.dedent(
        f"""
        import json, sys
        import salabatch, salabatch.api
        light = "mlx.core" not in sys.modules and callable(salabatch.load)
        model, tok = salabatch.load("builtin:random", cache_dir={str(cache_dir)!r})
        from salabatch.engine import blas
        print(json.dumps({{"light": light, "blas": blas.active().reason}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["light"]
    assert "imported before" not in out["blas"] and "not called" not in out["blas"]


def test_the_model_refuses_a_call_without_tokens(loaded):
    import mlx.core as mx

    model, _ = loaded
    with pytest.raises(ValueError, match=r"both ≥ 1, got shape \(1, 0\)"):
        model(mx.zeros((1, 0), dtype=mx.int32))


@pytest.mark.parametrize(
    ("call", "named", "shown"),
    [
        ({"temperature": "0.5"}, "temperature", "'0.5'"),
        ({"top_p": None}, "top_p", "None"),
        ({"temperature": -1}, "temperature", "-1"),
        ({"max_tokens": 2.0}, "max_tokens", "2.0"),
        ({"prompt": None}, "prompt", "None"),
        ({"prompt": ["a"]}, "prompt", "'a'"),
        ({"prompt": [1.5, 2.7]}, "prompt", "1.5"),  # int() made it [1, 2]
        ({"prompt": b"hi"}, "prompt", "b'hi'"),  # taken as the ids 104, 105
        ({"prompt": "2-D"}, "prompt", "shape (1, 3)"),
        ({"system": 5}, "system", "5"),
        ({"prompt": [5000]}, "prompt", "5000"),  # past the vocabulary: a TokenizerError before
        ({"prompt": []}, "prompt", "no tokens"),
        ({"prompt": [1, 2], "system": "Brief."}, "system", "needs a text prompt"),
        ({"draft": "bogus"}, "draft", "'bogus'"),  # a plain ValueError, naming no field
        ({"think": "no"}, "think", "'no'"),  # taken as true
        ({"prompt_progress_callback": 5}, "prompt_progress_callback", "5"),  # failed mid-prefill
    ],
)
def test_bad_arguments_are_typed_errors_naming_them(loaded, call, named, shown):
    """Raw TypeErrors, AttributeErrors and MLX errors that named nothing, or a prompt of bytes
    or floats taken as other token ids, before: a GenerationError (a ValueError too) naming the
    argument and showing its value."""
    import mlx.core as mx

    model, tok = loaded
    settings = {"prompt": "Say hi.", "max_tokens": 2, **call}
    if settings["prompt"] == "2-D":
        settings["prompt"] = mx.array([[5, 6, 7]])
    with pytest.raises(GenerationError) as e:
        salabatch.generate(model, tok, **settings)
    assert e.value.field == named and shown in str(e.value) and isinstance(e.value, ValueError)
    assert "SamplingParams(" not in str(e.value)  # the value, not the whole settings


def test_other_entry_points_name_their_own_bad_arguments(loaded):
    """`score`'s argument is `text` (it reused the prompt's name); a document of whitespace,
    `think` not a bool and `load(None)` are GenerationErrors naming theirs; mlx-lm's positional
    `verbose` is taken."""
    model, tok = loaded
    for call, named in (
        (lambda: salabatch.score(model, tok, b"abc"), "text"),
        (lambda: salabatch.score(model, tok, [1, 5000]), "text"),
        (lambda: salabatch.batch_generate(model, tok, "  ", ["q"]), "document"),
        (lambda: salabatch.batch_generate(model, tok, DOC, ["q"], think="no"), "think"),
        (lambda: salabatch.load(None), "path_or_ref"),
        (lambda: salabatch.load("builtin:random", cache_dir=5), "cache_dir"),  # a TypeError
    ):
        with pytest.raises(GenerationError) as e:
            call()
        assert e.value.field == named, e.value
    quiet = salabatch.generate(model, tok, "Say hi.", max_tokens=3)
    assert salabatch.generate(model, tok, "Say hi.", True, max_tokens=3) == quiet


def test_batch_generate_names_a_document_that_is_not_a_text(loaded):
    model, tok = loaded
    for document in (None, [[5, 6, 7]]):  # the second: mlx-lm's batch_generate(prompts)
        with pytest.raises(GenerationError) as e:
            salabatch.batch_generate(model, tok, document, QUESTIONS[:1], 2)
        assert e.value.field == "document"
    with pytest.raises(GenerationError, match="questions"):
        salabatch.batch_generate(model, tok, DOC, None)


def test_token_ids_may_be_a_1d_array(loaded):
    import mlx.core as mx
    import numpy as np

    model, tok = loaded
    ids = user_ids(tok, "Say hi.")
    text = salabatch.generate(model, tok, ids, max_tokens=4)
    assert salabatch.generate(model, tok, mx.array(ids), max_tokens=4) == text
    assert salabatch.generate(model, tok, np.array(ids), max_tokens=4) == text


@pytest.fixture
def context_64(loaded, monkeypatch):
    """builtin:random with a 64-token context, and a tokenizer without stop tokens."""
    import dataclasses

    from salabatch.engine import config as configs

    model, tok = loaded
    config = dataclasses.replace(model.config, max_position_embeddings=64)
    monkeypatch.setattr(configs, "CONTEXT_TOKENS", 64)  # the 1M floor: 64 tokens here
    monkeypatch.setattr(model, "config", config)
    endless = copy.copy(tok)
    endless.eos_ids = frozenset()
    return model, endless


def test_the_api_keeps_to_the_models_context_as_the_server_does(context_64, monkeypatch):
    """A prompt the context cannot hold is refused, naming it; max_tokens is cut where the
    context ends (the API decoded past it before: a 112-token prompt on a 64-token model
    answered 100 tokens)."""
    model, tok = context_64
    with pytest.raises(GenerationError, match="the model's context holds 64") as e:
        list(salabatch.stream_generate(model, tok, [5] * 64, max_tokens=4))
    assert e.value.field == "prompt"
    responses = list(salabatch.stream_generate(model, tok, [5] * 40, max_tokens=100))
    assert responses[-1].generation_tokens == 24 and responses[-1].finish_reason == "length"
    with pytest.raises(GenerationError, match="context") as e:
        salabatch.batch_generate(model, tok, "word " * 80, QUESTIONS[:1], 2)
    assert e.value.field == "document"
    doc_prompt = tok.document_prompt("Ferry.", system=None, think=False)
    question = tok.prompt_suffix("Why?", system=None, think=False)
    room = 64 - len(doc_prompt) - len(question)
    assert 0 < room < 100
    seen = record_generators(monkeypatch, generate_module)
    salabatch.batch_generate(model, tok, "Ferry.", ["Why?"], 100)
    assert [r.max_tokens for r in seen.requests] == [room]


def test_a_long_max_tokens_reserves_memory_as_the_answer_grows(loaded, monkeypatch):
    """A row's buffers were reserved for its prompt and whole max_tokens when it joined: with
    max_tokens 10**7, 2.8 GB on this toy for an answer that stopped at its first token."""
    model, tok = loaded
    reserved = []
    reserve = ModelCache.reserve

    def recording(self, tokens):
        reserved.append(tokens)
        return reserve(self, tokens)

    monkeypatch.setattr(ModelCache, "reserve", recording)
    prompt = user_ids(tok, "Say hi.")
    salabatch.generate(model, tok, prompt, max_tokens=6000)
    assert max(reserved) <= len(prompt) + salabatch.api.RESERVE_AHEAD + 64
    reserved.clear()
    salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], 6000)
    assert max(reserved) <= 2 * len(user_ids(tok, DOC)) + salabatch.api.RESERVE_AHEAD


def test_interleaved_streams_leave_the_process_settings_as_they_were(loaded):
    """Each stream held the engine's settings across its yields: two consumed in turn, the one
    finishing second put back the first's (the MLX cache limit and BLAS threads stayed changed)."""
    import mlx.core as mx
    from threadpoolctl import threadpool_info

    def threads() -> list[int]:
        return sorted({i["num_threads"] for i in threadpool_info()})

    model, tok = loaded
    alone = [
        [r.token for r in salabatch.stream_generate(model, tok, p, max_tokens=8)]
        for p in ("Say hi.", "Say bye.")
    ]
    previous = mx.set_cache_limit(12345)
    before = threads()
    try:
        a = salabatch.stream_generate(model, tok, "Say hi.", max_tokens=8)
        b = salabatch.stream_generate(model, tok, "Say bye.", max_tokens=8)
        together = [[], []]
        for x, y in zip(a, b, strict=False):
            together[0].append(x.token)
            together[1].append(y.token)
        together[0] += [r.token for r in a]
        together[1] += [r.token for r in b]
        assert together == alone
        assert mx.set_cache_limit(12345) == 12345 and threads() == before
    finally:
        mx.set_cache_limit(previous)


def test_what_cannot_fit_is_refused_before_its_prefill_and_the_rest_runs_in_its_plan(
    loaded, monkeypatch
):
    """As `salabatch run`: the API plans a prompt (or a document and its questions) before its
    prefill, refuses one that needs more memory than is free, and runs the rest within MLX's
    memory limit at the plan (each step of a stream; a document and its answers)."""
    from contextlib import contextmanager

    from salabatch.engine import memory
    from salabatch.errors import OutOfMemoryError

    model, tok = loaded
    limits = []
    bounded = memory.bounded

    @contextmanager
    def recorded(plan):
        with bounded(plan) as limit:
            limits.append(limit)
            yield limit

    monkeypatch.setattr(memory, "bounded", recorded)
    assert len(list(salabatch.stream_generate(model, tok, "Say hi.", max_tokens=4))) >= 1
    steps = len(limits)
    assert steps >= 1
    salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], 4)
    assert len(limits) == steps + 1
    monkeypatch.setattr(memory, "available_bytes", lambda gpu: 1 << 10)
    prefilled = []
    monkeypatch.setattr(generate_module, "prefill", lambda *a, **k: prefilled.append(a))
    # the advice names the call's own keywords, not a job file's keys
    with pytest.raises(OutOfMemoryError, match="is free: lower prefill_chunk or max_tokens"):
        salabatch.generate(model, tok, "Say hi.", max_tokens=4)
    with pytest.raises(OutOfMemoryError, match="is free: lower prefill_chunk, batch_size or"):
        salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], 4)
    with pytest.raises(OutOfMemoryError, match="is free: lower prefill_chunk, or free memory"):
        salabatch.score(model, tok, "Say hi.")
    assert not prefilled and len(limits) == steps + 1


def test_json_schema_or_choices_shape_the_answers(loaded):
    """stream_generate and batch_generate alike: JSON the schema validates, or one of the
    choices; both at once, or a bad one, refused by name before any work."""
    import json

    model, tok = loaded
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = salabatch.generate(model, tok, "Say hi.", max_tokens=30, json_schema=schema)
    assert set(json.loads(text)) == {"a"}
    answers = salabatch.batch_generate(
        model, tok, DOC, QUESTIONS[:2], max_tokens=8, choices=["yes", "no"]
    )
    assert len(answers) == 2 and set(answers) <= {"yes", "no"}
    # the keys in the schema's order (they were sorted: `answer` before `reasoning`, so the
    # model answered before it reasoned), as OpenAI's structured outputs give them
    ordered = {
        "type": "object",
        "properties": {"reasoning": {"type": "string"}, "answer": {"type": "boolean"}},
        "required": ["reasoning", "answer"],
    }
    text = salabatch.generate(model, tok, "Is it?", max_tokens=200, json_schema=ordered)
    assert list(json.loads(text)) == ["reasoning", "answer"], text
    # `<` and `>` are literal (escaped `\<` is a word's start to outlines-core: no DFA)
    brackets = ["< 1 year", "> 1 year", "<$1M>", "a-b (c).*"]
    answers = salabatch.batch_generate(model, tok, DOC, QUESTIONS[:2], choices=brackets)
    assert set(answers) <= set(brackets), answers
    for bad, named in (
        ({"json_schema": schema, "choices": ["x"]}, "choices"),
        ({"json_schema": {"type": "object", "properties": 5}}, "json_schema"),
        ({"json_schema": "{}"}, "json_schema"),
        ({"choices": "yes"}, "choices"),
        ({"choices": ["x", ""]}, "choices"),
    ):
        with pytest.raises(ValueError, match=named):
            salabatch.generate(model, tok, "Hi.", **bad)


def test_score_is_what_decoding_read_and_the_same_in_any_chunk(loaded):
    """`score` of a prompt and its greedy answer gives the answer's tokens the log-probabilities
    and alternatives decoding read for them; a text is scored as it is (its BOS then its
    tokens), in chunks of any size alike; `progress` sees each chunk; bad arguments are
    refused by name before any work."""
    model, tok = loaded
    ids = user_ids(tok, "Who runs the ferry?")
    answer = list(salabatch.stream_generate(model, tok, ids, max_tokens=6, logprobs=3))
    tokens = [r.token for r in answer if r.logprobs is not None]
    seen = []
    scores = salabatch.score(
        model, tok, ids + tokens, logprobs=3, prefill_chunk=16, progress=lambda *a: seen.append(a)
    )
    assert [x.token for x in scores] == (ids + tokens)[1:]
    assert seen[-1] == (len(ids) + len(tokens), len(ids) + len(tokens)) and len(seen) > 1
    for r, x in zip(answer, scores[len(ids) - 1 :], strict=False):
        assert x.logprob == pytest.approx(r.logprobs.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in r.logprobs.top]
    text = salabatch.score(model, tok, DOC)
    whole = salabatch.score(model, tok, DOC, prefill_chunk=4096)
    assert [x.token for x in text] == tok.encode(DOC, add_bos=tok.add_bos_token)[1:]
    assert [x.logprob for x in text] == pytest.approx([x.logprob for x in whole], abs=1e-4)
    assert all(x.top == () for x in text)
    for bad, field in (({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")):
        with pytest.raises(GenerationError) as e:
            salabatch.score(model, tok, DOC, **bad)
        assert e.value.field == field
    with pytest.raises(GenerationError) as e:
        salabatch.score(model, tok, "", prefill_chunk=0)
    assert e.value.field == "prefill_chunk"


def test_score_and_constrained_choices_refuse_what_they_cannot_use(loaded):
    """`progress` that is not callable failed after the first chunk with a bare TypeError;
    choices given as an iterator were used up by their check and gave an empty answer."""
    model, tok = loaded
    with pytest.raises(GenerationError) as e:
        salabatch.score(model, tok, "The ferry leaves at 7:10.", progress=5)
    assert e.value.field == "progress"
    with pytest.raises(GenerationError) as e:
        salabatch.generate(model, tok, "Yes or no?", max_tokens=4, choices=iter(["yes", "no"]))
    assert e.value.field == "choices"


def test_score_keeps_to_the_models_context(context_64):
    """A text the context holds is scored whole; one token more is refused, naming `text`."""
    short, tok64 = context_64
    with pytest.raises(GenerationError, match="the model's context holds 64") as e:
        salabatch.score(short, tok64, [5] * 65)
    assert e.value.field == "text"
    assert len(salabatch.score(short, tok64, [5] * 64)) == 63


def test_choose_gives_each_choice_its_probability_as_a_run_does(loaded):
    """`choose` gives every choice its probability after each question's prompt: the softmax
    of what one call over document, question, choice and end token gives them; in order;
    the same whatever the batch size; bad arguments are refused by name."""
    import numpy as np

    from tests.engine.test_choose import reference_logprobs

    model, tok = loaded
    choices = ["yes", "no", "not stated"]
    got = salabatch.choose(model, tok, DOC, QUESTIONS[:2], choices)
    for question, probs in zip(QUESTIONS[:2], got, strict=True):
        prompt = tok.document_prompt(DOC, system=None, think=False)
        prompt += tok.prompt_suffix(question, system=None, think=False)
        totals = reference_logprobs(model, tok, prompt, choices)
        want = np.exp(np.array(totals) - max(totals))
        assert list(probs) == choices
        assert list(probs.values()) == pytest.approx((want / want.sum()).tolist(), abs=1e-4)
    one = salabatch.choose(model, tok, DOC, QUESTIONS[:2], choices, batch_size=1)
    assert [list(p.values()) for p in one] == [
        pytest.approx(list(p.values()), abs=1e-5) for p in got
    ]
    assert salabatch.choose(model, tok, DOC, [], choices) == []
    for bad, field in (
        ({"choices": []}, "choices"),
        ({"choices": "yes"}, "choices"),
        ({"questions": "Why?"}, "questions"),
        ({"choices": ["yes", ""]}, "choices"),
        ({"choices": ["yes", "no", "yes"]}, "choices"),
        ({"batch_size": 0}, "batch_size"),
        ({"document": " \n "}, "document"),  # a TokenizerError without a field, before
    ):
        args = {"document": DOC, "questions": QUESTIONS[:1], "choices": choices} | bad
        with pytest.raises(GenerationError) as e:
            salabatch.choose(model, tok, **args)
        assert e.value.field == field


def test_choose_scores_a_question_as_alone_beside_one_on_the_other_side_of_dense_len(loaded):
    """A document below dense_len, one question's prompt past it, one's not: each question's
    prefix as its own prompt's one call runs it (the shared prefix was planned from the
    shortest question only: the longer one was scored over a dense prefix, an audit)."""
    model, tok = loaded
    dense_len = model.config.sparse.dense_len
    questions = [
        "Which word comes most often in the text above, and how many times does it come?",
        "Name it.",
    ]
    heads = [len(tok.prompt_suffix(q, system=None, think=False)) for q in questions]
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "lamp", "quiet", "north", "seven"]
    doc = " ".join(np.random.default_rng(0).choice(words, 3000))
    while len(tok.document_prompt(doc, system=None, think=False)) > dense_len - 20:
        doc = doc[: int(len(doc) * 0.98)].rsplit(" ", 1)[0]
    while (n := len(tok.document_prompt(doc, system=None, think=False))) + heads[
        1
    ] + 1 >= dense_len:
        doc = doc.rsplit(" ", 1)[0]  # the second question's prompt below dense_len
    assert n + heads[0] + 1 >= dense_len  # the first's past it
    choices = ["alpha", "beta", "stone"]
    together = salabatch.choose(model, tok, doc, questions, choices)
    for question, probs in zip(questions, together, strict=True):
        (alone,) = salabatch.choose(model, tok, doc, [question], choices)
        assert list(probs.values()) == pytest.approx(list(alone.values()), abs=1e-6, rel=0)


def test_logit_bias_reaches_the_engine_and_bad_ones_are_refused_by_name(loaded):
    """`logit_bias` +100 on a token makes the greedy answer that token (stream_generate and
    batch_generate alike); a token past the vocabulary, a bias out of range or keys that are
    not token ids are GenerationErrors naming logit_bias."""
    model, tok = loaded
    token = tok.encode("Q")[-1]
    forced = [
        r.token for r in salabatch.stream_generate(model, tok, "Hi", 4, logit_bias={token: 100})
    ]
    assert forced == [token] * 4
    (answer,) = salabatch.batch_generate(model, tok, DOC, QUESTIONS[:1], 3, logit_bias={token: 100})
    assert answer == tok.decode([token] * 3, skip_special=True)
    for bad in ({10**7: 1.0}, {token: 101.0}, {"5": 1.0}, [token]):
        with pytest.raises(GenerationError) as e:
            list(salabatch.stream_generate(model, tok, "Hi", 2, logit_bias=bad))
        assert e.value.field == "logit_bias"
