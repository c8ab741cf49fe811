"""Generation: greedy batches equal each request alone (dense and sparse), sampling is
reproducible per (prompt, seed), stop tokens, stop strings and max_tokens end a row."""

from __future__ import annotations

import numpy as np
import pytest

from salabatch.engine.generate import Generator, Request, prefill
from salabatch.engine.load import load_model
from salabatch.engine.sampling import SamplingParams
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.models import resolve_model
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("g"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, 256, size=n).tolist())


GREEDY = SamplingParams()


def questions(n=8, max_tokens=24, params=GREEDY):
    lengths = [5, 17, 1, 9, 30, 2, 12, 7][:n]
    return [
        Request(f"q{i}", ids(length, 40 + i), params, max_tokens)
        for i, length in enumerate(lengths)
    ]


def run(model, requests, prefix=None, batch_size=8):
    out = Generator(model, batch_size=batch_size).generate(requests, prefix)
    return {g.request.id: g for g in out}


@pytest.mark.parametrize("doc_len", [150, 600], ids=["dense", "sparse"])
def test_greedy_batch_over_shared_prefix_equals_each_alone(model, doc_len):
    doc = model.make_cache()
    prefill(model, ids(doc_len, 1), doc)
    reqs = questions()
    together = run(model, reqs, doc, batch_size=8)
    small = run(model, reqs, doc, batch_size=3)  # rows leave and join while others decode
    for r in reqs:
        alone_cache = model.make_cache()
        prefill(model, ids(doc_len, 1), alone_cache)
        alone = run(model, [r], alone_cache, batch_size=1)[r.id]
        assert together[r.id].tokens == alone.tokens, r.id
        assert small[r.id].tokens == alone.tokens, r.id
        assert together[r.id].cached_tokens == doc_len
        assert len(alone.tokens) == 24 and alone.finish_reason == "length"


def test_unrelated_prompts_batch_equals_each_alone(model):
    reqs = [Request(f"d{i}", ids(n, n)) for i, n in enumerate((30, 300, 7, 270))]
    reqs = [Request(r.id, r.prompt, max_tokens=10) for r in reqs]
    together = run(model, reqs, batch_size=4)
    for r in reqs:
        assert together[r.id].tokens == run(model, [r], batch_size=1)[r.id].tokens


def test_same_seed_same_sample_whatever_the_batch(model):
    hot = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    reqs = questions(params=hot, max_tokens=16)
    a = run(model, reqs, batch_size=8)
    b = run(model, reqs[3:4], batch_size=1)
    c = run(model, list(reversed(reqs)), batch_size=2)
    assert a["q3"].tokens == b["q3"].tokens == c["q3"].tokens
    other_seed = Request("q3", reqs[3].prompt, SamplingParams(1.0, 0.9, 50, seed=8), 16)
    assert run(model, [other_seed])["q3"].tokens != a["q3"].tokens


def test_stop_tokens_and_max_tokens(model):
    free = run(model, [Request("a", ids(20, 3), max_tokens=12)])["a"]
    stop_at = free.tokens[5]
    stopped = run(model, [Request("a", ids(20, 3), max_tokens=12, stop=frozenset({stop_at}))])["a"]
    first = free.tokens.index(stop_at)
    assert stopped.tokens == free.tokens[:first] and stopped.finish_reason == "stop"
    one = run(model, [Request("a", ids(20, 3), max_tokens=1)])["a"]
    assert one.tokens == free.tokens[:1] and one.finish_reason == "length"


def test_timings_are_recorded(model):
    g = run(model, [Request("a", ids(50, 2), max_tokens=8)])["a"]
    assert g.prompt_tokens == 50 and g.completion_tokens == 8
    assert 0 < g.prefill_s <= g.ttft_s and g.decode_s > 0 and g.decode_tok_s > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """builtin:random (an untrained test model) with its tokenizer, for decoded text."""
    path = resolve_model("builtin:random", tmp_path_factory.mktemp("builtin"))
    return load_model(path, dtype="float32"), load_tokenizer(path)


def test_stop_strings_cut_the_text_before_the_first_one(tiny):
    model, tok = tiny
    prompt = tuple(tok.chat_prompt_ids([{"role": "user", "content": "Name a river."}], think=False))

    def generate(*requests: Request) -> dict:
        detok = lambda after: tok.detokenizer(skip_special=True, after=after)  # noqa: E731
        out = Generator(model, batch_size=4, detokenizer=detok).generate(requests)
        return {g.request.id: g for g in out}

    free = run(model, [Request("free", prompt, max_tokens=24)])["free"]
    text = tok.decode(free.tokens, skip_special=True)
    stop = text[len(text) // 2 :][:3]  # text the answer provably contains, past its start
    cut = text.find(stop)
    assert 0 < cut < len(text) - 3, text
    got = generate(
        Request("stopped", prompt, max_tokens=24, stop_strings=(stop, "never in it")),
        Request("free", prompt, max_tokens=24),  # decodes beside it, unaffected
        Request("no match", prompt, max_tokens=24, stop_strings=("never in it",)),
    )
    stopped = got["stopped"]
    assert stopped.text == text[:cut] and stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[: len(stopped.tokens)] and len(stopped.tokens) < 24
    assert tok.decode(stopped.tokens, skip_special=True).startswith(text[:cut] + stop)
    assert got["free"].tokens == free.tokens and got["free"].text is None
    assert got["no match"].text == text and got["no match"].finish_reason == "length"
    # two stop strings: the one that appears first in the text wins, whatever their order
    earlier = text[cut - 2 : cut]
    both = generate(Request("r", prompt, max_tokens=24, stop_strings=(stop, earlier)))["r"]
    assert both.text == text[: text.find(earlier)]


def test_stop_strings_need_a_detokenizer(model):
    with pytest.raises(ValueError, match="detokenizer"):
        run(model, [Request("a", ids(5, 1), stop_strings=("x",))])
    with pytest.raises(ValueError, match="empty"):
        Request("a", ids(5, 1), stop_strings=("",))


def test_answer_room_is_max_tokens_cut_at_the_context(model):
    """The rule the API, the CLI and the server share: a prompt leaving no room for one token
    is refused, naming the field; max_tokens stops where the context ends."""
    from salabatch.engine.generate import answer_room
    from salabatch.errors import GenerationError

    context = model.config.context_length
    assert answer_room(model.config, 10, 5) == 5
    assert answer_room(model.config, context - 7, 100) == 7
    assert answer_room(model.config, context - 1, 100) == 1
    for n in (context, context + 50):
        with pytest.raises(GenerationError, match=f"the prompt has {n} tokens") as e:
            answer_room(model.config, n, 1, field="questions[2]")
        assert e.value.field == "questions[2]" and isinstance(e.value, ValueError)


def test_the_repetition_penalty_counts_the_answer_only(model):
    """As documented (README, `sampling`): unlike HF's and mlx-lm's, the prompt's tokens are not
    counted, so the first token is the plain one however strong the penalty."""
    prompt = ids(12, 3)
    plain = run(model, [Request("p", prompt, GREEDY, 4)])["p"].tokens
    strong = SamplingParams(repetition_penalty=1e30)
    penalised = run(model, [Request("p", prompt, strong, 4)])["p"].tokens
    assert penalised[0] == plain[0]
    assert len(set(penalised)) == len(penalised)  # later tokens: no answer token twice


def test_logprobs_are_log_softmax_of_one_call_over_prompt_and_answer(model):
    """Each token's log-probability and top alternatives are log_softmax of the logits that one
    call over the prompt and answer gives at its position, whatever the batch: rows with and
    without logprobs, sampled and greedy, dense and sparse (past 256), one joining as another
    leaves, drafting on (a row with logprobs takes plain steps). Asking changes no token; a row
    that does not ask gets none."""
    import mlx.core as mx

    from salabatch.engine.speculative import Speculation

    hot = SamplingParams(temperature=1.0, seed=3)
    reqs = [
        Request("top5", ids(9, 1), hot, 12, logprobs=5),
        Request("none", ids(17, 2), GREEDY, 6),
        Request("top0", ids(300, 3), GREEDY, 12, logprobs=0),
        Request("top20", ids(40, 4), GREEDY, 8, logprobs=20),
    ]
    plain = run(model, [Request(r.id, r.prompt, r.params, r.max_tokens) for r in reqs])
    for gen in (
        Generator(model, batch_size=2),
        Generator(model, batch_size=3, speculation=Speculation("lookup", tokens=3)),
    ):
        out = {g.request.id: g for g in gen.generate(reqs)}
        assert {r: g.tokens for r, g in out.items()} == {r: g.tokens for r, g in plain.items()}
        assert out["none"].logprobs == []
        for r in (r for r in reqs if r.logprobs is not None):
            g = out[r.id]
            whole = model(mx.array([list(r.prompt) + g.tokens[:-1]]), model.make_cache())
            lp = whole[0, len(r.prompt) - 1 :].astype(mx.float32)
            lp = np.array(lp - mx.logsumexp(lp, axis=-1, keepdims=True))
            assert [x.token for x in g.logprobs] == g.tokens
            for i, x in enumerate(g.logprobs):
                assert x.logprob == pytest.approx(lp[i, g.tokens[i]], abs=2e-4), (r.id, i)
                best = np.argsort(-lp[i], kind="stable")[: r.logprobs]
                assert [t for t, _ in x.top] == best.tolist(), (r.id, i)
                assert [v for _, v in x.top] == pytest.approx(lp[i, best], abs=2e-4)


@pytest.mark.parametrize(
    "n, chunk", [(40, 16), (600, 128), (600, 600)], ids=["dense", "sparse", "whole"]
)
def test_scored_prefill_is_log_softmax_of_one_call(model, n, chunk, monkeypatch, engine_path):
    """A scored prefill gives each token after the first its log-probability and top
    alternatives under log_softmax of one call's logits at the position before it, chunked or
    not, dense or sparse, on both paths, the head run a few positions at a time (SCORE_ELEMENTS
    made small); its last logits are the unscored prefill's."""
    import mlx.core as mx

    from salabatch.engine import memory
    from salabatch.engine.generate import Prefill

    monkeypatch.setattr(memory, "SCORE_ELEMENTS", 7 * model.config.vocab_size)
    prompt = ids(n, 11)
    whole = model(mx.array([list(prompt)]), model.make_cache())[0].astype(mx.float32)
    lp = np.array(whole - mx.logsumexp(whole, axis=-1, keepdims=True))
    feed = Prefill(model, prompt, model.make_cache(), chunk, score=3)
    while not feed.finished:
        feed.step()
    scores = feed.scores()
    assert [x.token for x in scores] == list(prompt[1:])
    for i, x in enumerate(scores):
        assert x.logprob == pytest.approx(lp[i, prompt[i + 1]], abs=2e-4), i
        best = np.argsort(-lp[i], kind="stable")[:3]
        assert [t for t, _ in x.top] == best.tolist(), i
        assert [v for _, v in x.top] == pytest.approx(lp[i, best], abs=2e-4)
    plain = model.make_cache()
    last = prefill(model, prompt, plain, chunk)
    assert np.allclose(np.array(feed.logits()), np.array(last), atol=1e-5)
    bare = Prefill(model, prompt[:1], model.make_cache(), chunk, score=0)
    bare.step()
    assert bare.scores() == []
    with pytest.raises(ValueError, match="score must be in"):
        Prefill(model, prompt, model.make_cache(), chunk, score=21)


def test_a_grammar_keeps_the_answer_in_its_pattern_and_the_others_as_alone(tiny):
    """An untrained model, sampling hot: answers under a JSON schema parse and validate, one
    under a regex matches it whole, each ending at the end token (stop) once complete; a row
    without a grammar decoding beside them gets its answer alone; a guided row gets the same
    answer alone as in the batch, drafting on or off (a guided batch takes plain steps)."""
    import json
    import re

    from salabatch.engine.grammar import Grammars
    from salabatch.engine.speculative import Speculation

    model, tok = tiny
    grammars = Grammars(tok)
    prompt = tuple(tok.chat_prompt_ids([{"role": "user", "content": "Give me JSON."}], think=False))
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    hot = SamplingParams(temperature=1.0, seed=5)
    stop = frozenset(tok.eos_ids)
    reqs = [
        Request("schema", prompt, hot, 80, stop, grammar=grammars.json_schema(schema)),
        Request("regex", prompt, hot, 40, stop, grammar=grammars.regex(r"[A-Z]{2}-[0-9]{3}")),
        Request("free", prompt, hot, 12, stop),
        Request("greedy", prompt, GREEDY, 80, stop, grammar=grammars.json_schema(schema)),
        # no stop tokens of its own: the grammar's end still ends it
        Request("no stops", prompt, hot, 40, frozenset(), grammar=grammars.regex(r"[a-z]{2}")),
    ]
    for gen in (
        Generator(model, batch_size=4),
        Generator(model, batch_size=2, speculation=Speculation("lookup", tokens=3)),
    ):
        out = {g.request.id: g for g in gen.generate(reqs)}
        for rid in ("schema", "greedy"):
            value = json.loads(tok.decode(out[rid].tokens))
            assert set(value) == {"name", "n"} and isinstance(value["n"], int), value
            assert out[rid].finish_reason == "stop"
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", tok.decode(out["regex"].tokens))
        assert out["regex"].finish_reason == "stop" and out["regex"].last_token in stop
        ended = out["no stops"]
        assert re.fullmatch("[a-z]{2}", tok.decode(ended.tokens)) and ended.finish_reason == "stop"
        assert ended.last_token == reqs[-1].grammar.end
        for r in reqs:
            assert out[r.id].tokens == run(model, [r], batch_size=1)[r.id].tokens, r.id
    assert grammars.json_schema(schema) is reqs[0].grammar  # compiled once


def test_a_pattern_is_compiled_once_by_threads_asking_for_it_together(tiny, monkeypatch):
    """Eight threads ask for one pattern at once: one compiles it, the others get its grammar;
    a pattern that cannot be compiled is tried once and refused the same way after."""
    import threading
    import time

    from salabatch.engine import grammar as grammar_module
    from salabatch.engine.grammar import Grammars
    from salabatch.errors import GenerationError

    _, tok = tiny
    compiled: list[str] = []
    real = grammar_module.compile_index

    def slow(pattern, vocabulary, *bounds):
        compiled.append(pattern.removeprefix("(?:").removesuffix(f"){grammar_module.SENTINEL}"))
        time.sleep(0.2)
        return real(pattern, vocabulary, *bounds)

    monkeypatch.setattr(grammar_module, "compile_index", slow)
    grammars = Grammars(tok)
    got: list = []
    threads = [
        threading.Thread(target=lambda: got.append(grammars.regex("[0-9]{3}"))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiled == ["[0-9]{3}"] and len(got) == 8 and all(g is got[0] for g in got)
    for _ in range(2):
        with pytest.raises(GenerationError, match="pattern cannot be used"):
            grammars.regex("(?=a)b")
    assert compiled == ["[0-9]{3}", "(?=a)b"]


def test_a_complete_pattern_may_go_on_where_it_can_complete_again(tiny):
    """Where the pattern is complete, the end token and every token that can still lead to
    another completion: after "1" of `1(\\.5)?` the "." (outlines-core allowed only the end:
    a number schema never gave a decimal, choices "no"/"nope" never "nope"); the end token
    nowhere else, not even where the pattern takes any character (a JSON string)."""
    from salabatch.engine.grammar import SENTINEL, Grammars, allowed_tokens

    _, tok = tiny
    grammars = Grammars(tok)
    cases = (
        (r"1(\.5)?", "1", ".", True),
        ("(no|nope)", "no", "p", True),
        ("a*", "", "a", True),
        ('"[^"]*"', '"ab', "c", False),  # inside the string: any character, the end's too
    )
    for pattern, text, then, complete in cases:
        grammar = grammars.regex(pattern)
        guide = grammar.guide()
        for token in tok.encode(text, special=False):
            guide.advance(token, return_tokens=False)
        allowed = allowed_tokens([(guide, grammar)], tok.vocab_size)[0]
        assert allowed[grammar.end].item() == complete, pattern
        assert allowed[tok.encode(then, special=False)[0]].item(), pattern
    assert not any(SENTINEL.encode() in tok.token_bytes(t) for t in range(tok.vocab_size))


def test_a_pattern_whose_compile_explodes_is_refused_within_its_bounds(tiny):
    """An array of at least 4 JSON values: its automaton explodes (72 s and 3 GB on this
    1,024-token vocabulary, unbounded: a server compiled whatever a client sent). The compile
    runs in a child process that is killed past its time, or dies past its memory (where the
    system caps it): a GenerationError saying which, soon; the next pattern compiles."""
    import sys
    import time

    from salabatch.engine.grammar import Grammars
    from salabatch.errors import GenerationError

    _, tok = tiny
    explodes = {"type": "array", "minItems": 4}
    start = time.perf_counter()
    with pytest.raises(GenerationError, match=r"took over 0.5 s: simplify the pattern"):
        Grammars(tok, seconds=0.5).json_schema(explodes)
    assert time.perf_counter() - start < 5
    if sys.platform == "linux":  # macOS does not enforce an address-space cap
        small = Grammars(tok, seconds=60, max_bytes=2**28)
        with pytest.raises(GenerationError, match=r"took over 0.25 GB: simplify the pattern"):
            small.json_schema(explodes)
        assert small.regex("[0-9]{3}").pattern == "[0-9]{3}"


def test_logit_bias_bans_or_forces_tokens_and_the_other_rows_are_as_alone(model):
    """-100 on the token a greedy row would take first keeps it out of the whole answer; +100 on
    one token makes every token that one; rows without a bias beside them, drafting on, answer
    as alone; log-probabilities stay the model's (the bias is not in them); a token past the
    vocabulary is refused."""
    import mlx.core as mx

    from salabatch.engine.speculative import Speculation
    from salabatch.errors import GenerationError

    prompt = ids(20, 9)
    plain = run(model, [Request("p", prompt, GREEDY, 10)])["p"].tokens
    ban = SamplingParams(logit_bias=((plain[0], -100.0),))
    force = SamplingParams(logit_bias=((77, 100.0),))
    reqs = [
        Request("ban", prompt, ban, 10),
        Request("force", prompt, force, 6, logprobs=1),
        Request("free", ids(30, 10), GREEDY, 10),
    ]
    for gen in (
        Generator(model, batch_size=3),
        Generator(model, batch_size=3, speculation=Speculation("lookup", tokens=3)),
    ):
        out = {g.request.id: g for g in gen.generate(reqs)}
        assert plain[0] not in out["ban"].tokens and out["ban"].tokens != plain
        assert out["force"].tokens == [77] * 6
        for r in reqs:
            assert out[r.id].tokens == run(model, [r])[r.id].tokens, r.id
        whole = model(mx.array([list(prompt)]), model.make_cache())[0, -1].astype(mx.float32)
        raw = float((whole - mx.logsumexp(whole))[77])
        assert out["force"].logprobs[0].logprob == pytest.approx(raw, abs=2e-4)
    far = Request("x", prompt, SamplingParams(logit_bias=((10**6, 1.0),)), 2)
    with pytest.raises(ValueError, match="past the vocabulary"):
        list(Generator(model).generate([far]))
    for bad in (((1, 101.0),), ((-1, 1.0),), ((1.5, 1.0),), ((1,),)):
        with pytest.raises(GenerationError):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("draft", ["off", "lookup"])
def test_a_row_cancelled_before_it_joins_reads_nothing(model, draft):
    """The server cancels a row it added before the batch's next step: the row never joins (it
    joined, read a token, called on_token after its end and took back finish_reason)."""
    import time

    from salabatch.engine.generate import Batch
    from salabatch.engine.speculative import Speculation

    read = []
    batch = Batch(
        model,
        forked=False,
        on_token=lambda r, t: read.append(r.id),
        speculation=Speculation(draft, 3),
    )

    def add(rid: str):
        req = Request(rid, ids(6, len(rid)), max_tokens=5)
        cache = model.make_cache()
        return batch.add(
            req, cache, prefill(model, req.prompt, cache), admitted=time.perf_counter()
        )

    kept, gone = add("kept"), add("gone")
    batch.cancel(gone)
    while not kept.done:
        batch.step()
    assert gone.finish_reason == "cancelled" and not gone.tokens and gone.last_token is None
    assert set(read) == {"kept"} and len(kept.tokens) == 5
    alone = add("alone")
    batch.cancel(alone)
    assert batch.step() == [] and alone.finish_reason == "cancelled" and not batch.rows
    if draft == "lookup":
        assert not batch._lookup._rows  # the cancelled rows' documents left with them
