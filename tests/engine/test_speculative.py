"""Speculative decoding: a rollback keeps exactly the tokens kept, greedy speculation gives plain
greedy decoding's tokens (every drafter, batch 1 and 8, dense, sparse and across dense_len, 300
tokens), rejection sampling keeps plain sampling's distribution, the drafters and the auto
policy do what they say."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine import lightning, sparse
from salabatch.engine.generate import Batch, Generation, Generator, Request, prefill
from salabatch.engine.kernels import native, sparse_decode
from salabatch.engine.load import load_model
from salabatch.engine.sampling import SamplingParams, sample_tokens
from salabatch.engine.sparse_cache import SparseKVCache
from salabatch.engine.speculative import (
    Lookup,
    Policy,
    RowStats,
    RowText,
    Speculation,
    verify,
)
from salabatch.engine.tokenizer import load_tokenizer
from salabatch.models import resolve_model
from tests.tiny import SPARSE_AT_256, SPARSE_AT_512, tiny_config_dict, write_tiny_checkpoint

ATOL = 2e-5  # float32: a verify pass and decode steps differ by rounding at most


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("s"), tiny_config_dict(**SPARSE_AT_256))
    return load_model(path, dtype="float32")


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


def document(model, n: int):
    tokens = tuple(ids(n, 1))
    cache = model.make_cache()
    prefill(model, tokens, cache)
    return tokens, cache


# -- the rollback ---------------------------------------------------------------------------------
@pytest.fixture(params=["states", "replay"])
def lightning_kept(request, monkeypatch):
    """How a verify pass's lightning layers can be rolled back: from the state after each token
    (kept where small, `lightning.STATES_BYTES`), or by replaying the k, v they were fed."""
    if request.param == "replay":
        monkeypatch.setattr(lightning, "STATES_BYTES", 0)
    return request.param


@pytest.mark.parametrize("doc_len", [150, 600], ids=["dense", "sparse"])
def test_rollback_keeps_exactly_the_tokens_kept(model, doc_len, engine_path, lightning_kept):
    """Rows fed 7 tokens in one recorded pass, then rolled back to 1, 4 and 7 of them (or 0, 3
    and 7: a row keeping none beside rows keeping some), continue as rows that decoded just
    those tokens one by one (states, keys, chunks, positions); also with 4 tokens kept by every
    row, and 0."""
    _, doc = document(model, doc_len)
    fed = [ids(7, 20 + b) for b in range(3)]
    for keep in ([1, 4, 7], [0, 3, 7]):
        cache = doc.fork(3)
        point = cache.checkpoint()
        model(mx.array(fed), cache)
        cache.rollback(point, keep)
        after = model(mx.array([[9], [9], [9]]), cache)[:, -1]
        for b in range(3):
            alone = doc.fork(1)
            for token in fed[b][: keep[b]]:
                model(mx.array([[token]]), alone)
            want = model(mx.array([[9]]), alone)[:, -1]
            assert cache.positions[b] == alone.positions[0]
            np.testing.assert_allclose(
                np.array(after[b]), np.array(want[0]), atol=ATOL, err_msg=f"keep {keep}, row {b}"
            )
        sparse = next(c for c in cache if isinstance(c, SparseKVCache))
        assert sparse.keys.lengths == [n - sparse.start + 1 for n in (doc_len + k for k in keep)]
    for same in (4, 0):  # every row alike
        cache = doc.fork(3)
        point = cache.checkpoint()
        model(mx.array(fed), cache)
        cache.rollback(point, [same] * 3)
        after = model(mx.array([[9], [9], [9]]), cache)[:, -1]
        for b in range(3):
            alone = doc.fork(1)
            for token in fed[b][:same]:
                model(mx.array([[token]]), alone)
            want = model(mx.array([[9]]), alone)[:, -1]
            np.testing.assert_allclose(np.array(after[b]), np.array(want[0]), atol=ATOL)


def test_ragged_prefill_rolls_each_row_back_to_its_own_length(model):
    """Prompts of different lengths prefilled as one padded batch (recorded, as a prefill),
    then each rolled back to its length, equal each prompt prefilled alone."""
    _, doc = document(model, 600)
    prompts = [ids(n, 10 + n) for n in (5, 30, 1, 17)]
    T = max(map(len, prompts))
    cache = doc.fork(len(prompts))
    point = cache.checkpoint(stepwise=False)
    h = model.hidden(mx.array([p + [0] * (T - len(p)) for p in prompts]), cache)
    last = model.logits(mx.stack([h[b, len(p) - 1] for b, p in enumerate(prompts)]))
    cache.rollback(point, [len(p) for p in prompts])
    after = model(mx.array([[7]] * len(prompts)), cache)[:, -1]
    for b, p in enumerate(prompts):
        alone = doc.fork(1)
        logits = prefill(model, p, alone)
        np.testing.assert_allclose(np.array(last[b]), np.array(logits), atol=ATOL)
        want = model(mx.array([[7]]), alone)[0, -1]
        np.testing.assert_allclose(np.array(after[b]), np.array(want), atol=ATOL)


def test_rollback_without_a_record_only_returns_to_the_checkpoint(model):
    _, doc = document(model, 150)
    cache = doc.fork(1)
    point = cache.checkpoint(record=False)
    model(mx.array([[5, 6]]), cache)
    with pytest.raises(ValueError, match="record"):
        cache.rollback(point, [1])


@pytest.mark.parametrize("doc_len", [150, 600], ids=["dense", "sparse"])
def test_a_verify_pass_computes_exactly_what_decode_steps_compute(
    model, doc_len, monkeypatch, lightning_kept
):
    """On the CPU path (native kernels, float32) a pass over 5 tokens per row, rows at
    different positions, gives bit for bit the logits of decoding those tokens one by one:
    the sparse layers take the pass's queries in one native call (5 rows of queries per row of
    keys), each computed as its own step."""
    _, doc = document(model, doc_len)

    def ragged():  # rows at positions n, n + 1, n + 2
        cache = doc.fork(3)
        point = cache.checkpoint()
        model(mx.array([[4, 4]] * 3), cache)
        cache.rollback(point, [0, 1, 2])
        return cache

    cache, steps = ragged(), ragged()
    together = []  # the native calls that took a pass's queries at once
    for name in ("dense_step", "infllm_v2_step"):
        kernel = getattr(sparse, name)

        def spy(*args, kernel=kernel, **kw):
            together.append(kw.get("queries", 1))
            return kernel(*args, **kw)

        monkeypatch.setattr(sparse, name, spy)
    fed = [ids(5, 30 + b) for b in range(3)]
    cache.checkpoint()
    passed = model(mx.array(fed), cache)
    one_by_one = mx.stack(
        [model(mx.array([[f[t]] for f in fed]), steps)[:, -1] for t in range(5)], axis=1
    )
    assert cache.positions == steps.positions == [doc_len + 5 + b for b in range(3)]
    if native.missing() is None:
        assert 5 in together
    assert mx.array_equal(passed, one_by_one)


def test_a_verify_pass_whose_last_query_reaches_dense_len_attends_as_its_steps(tmp_path):
    """A pass from 506 to 511 with dense_len 512 (where sparse attention, 4 of 8 blocks, is not
    dense): its last query's sequence reaches dense_len, so that query attends sparsely as its
    decode step does, the others densely (it was taken with the first query's mode, dense:
    greedy speculation changed a token there); and the drafts a batch gives a row keep every
    pass below dense_len, where its queries go together."""
    path = write_tiny_checkpoint(tmp_path, tiny_config_dict(**SPARSE_AT_512))
    model = load_model(path, dtype="float32")
    _, doc = document(model, 506)
    fed = [ids(6, 70 + b) for b in range(2)]
    cache, steps = doc.fork(2), doc.fork(2)
    cache.checkpoint()
    passed = model(mx.array(fed), cache)
    one_by_one = mx.stack(
        [model(mx.array([[f[t]] for f in fed]), steps)[:, -1] for t in range(6)], axis=1
    )
    assert mx.abs(passed - one_by_one).max().item() < ATOL
    batch = Batch(model, forked=True, speculation=Speculation("lookup", tokens=8))
    rows = [Generation(Request("q", (5,), max_tokens=50))]
    batch.cache = doc.fork(1)
    for position, room in ((506, 4), (509, 1), (510, 0), (511, 8), (600, 8)):
        batch.cache.positions = [position]
        assert batch._draft_room(rows, 8) == [room], position


@pytest.mark.parametrize(
    ("forked", "grid"),
    [(True, None), (False, None), (True, 100)],
    ids=["rows over shared keys", "own keys", "over the launch grid"],
)
def test_a_verify_pass_takes_its_sparse_queries_at_once_off_the_native_step(
    model, monkeypatch, forked, grid
):
    """Off the native step (its MLX-op graphs, what the GPU path runs), a sparse layer still
    takes a pass's queries in one call, T query rows reading their row's keys in place, and
    the pass gives what decoding the tokens one by one gives, rows at different positions; one
    by one where the batched block products would reach the launch grid (GRID_ROWS)."""
    monkeypatch.setattr(sparse_decode, "CPU_STEP", "blocks")
    if grid:
        monkeypatch.setattr(sparse, "GRID_ROWS", grid)
    _, doc = document(model, 600)

    def rows():  # rows at positions n, n + 1, n + 2
        cache = doc.fork(3) if forked else doc.select([0, 0, 0])
        point = cache.checkpoint()
        model(mx.array([[4, 4]] * 3), cache)
        cache.rollback(point, [0, 1, 2])
        return cache

    cache, steps = rows(), rows()
    layer = next(c for c in cache.layers if isinstance(c, SparseKVCache))
    assert (layer.kv_view().start > 0) == forked
    together = []
    kernel = sparse.infllm_v2_step

    def spy(*args, **kw):
        together.append(kw.get("queries", 1))
        return kernel(*args, **kw)

    monkeypatch.setattr(sparse, "infllm_v2_step", spy)
    fed = [ids(5, 50 + b) for b in range(3)]
    cache.checkpoint()
    passed = model(mx.array(fed), cache)
    one_by_one = mx.stack(
        [model(mx.array([[f[t]] for f in fed]), steps)[:, -1] for t in range(5)], axis=1
    )
    assert (5 in together) == (grid is None)
    assert mx.abs(passed - one_by_one).max().item() < ATOL


# -- greedy identity ------------------------------------------------------------------------------
def generate(model, requests, prefix, batch_size, draft="off", **settings):
    spec = Speculation(draft, **settings)
    out = Generator(model, batch_size=batch_size, speculation=spec).generate(requests, prefix)
    return {g.request.id: g for g in out}


@pytest.mark.parametrize("draft", ["lookup", "layers", "auto"])
@pytest.mark.parametrize(
    "doc_len", [150, 600], ids=["dense-then-sparse", "sparse"]
)  # 150: the answers cross dense_len (256)
def test_greedy_speculation_gives_plain_greedy_tokens(model, draft, doc_len):
    context, doc = document(model, doc_len)
    lengths = [5, 17, 1, 9, 30, 2, 12, 7]
    reqs = [
        Request(f"q{i}", tuple(ids(n, 40 + i)), max_tokens=300, context=context)
        for i, n in enumerate(lengths)
    ]
    for batch, rows in ((8, reqs), (1, reqs[:2])):
        plain = generate(model, rows, doc, batch)
        spec = generate(model, rows, doc, batch, draft)
        for r in rows:
            assert spec[r.id].tokens == plain[r.id].tokens, (batch, r.id)
            assert spec[r.id].finish_reason == plain[r.id].finish_reason
        drafted = sum(g.draft_tokens for g in spec.values())
        accepted = sum(g.accepted_tokens for g in spec.values())
        assert 0 <= accepted <= drafted
        if draft != "auto":
            assert accepted > 0  # the passes ran and kept drafts


def test_accepted_drafts_are_those_in_the_answer(model, monkeypatch):
    """Drafts that are plain decoding's own tokens, 8 a pass, over a stop token: the answer is
    plain decoding's, and the accepted count holds only the drafts in it (it counted the stop
    token and the drafts after it: more accepted than the answer's tokens)."""
    prompt = tuple(ids(12, 90))
    plain = generate(model, [Request("q", prompt, max_tokens=40)], None, 1)["q"].tokens
    at = next(i for i in range(10, 40) if plain[i] not in plain[:i])
    request = Request("q", prompt, max_tokens=40, stop=frozenset({plain[at]}))

    def oracle(self, row, limit):
        done = len(row.own) - row.prompt
        return plain[done : done + limit]

    monkeypatch.setattr(Lookup, "propose", oracle)
    g = generate(model, [request], None, 1, "lookup", tokens=8)["q"]
    assert g.tokens == plain[:at] and g.finish_reason == "stop"
    assert g.draft_tokens > g.accepted_tokens > 0
    assert g.accepted_tokens <= g.completion_tokens - 1  # the first token is no draft


@pytest.mark.parametrize("draft", ["lookup", "auto"])
def test_sampled_speculation_with_certain_drafts_gives_plain_samplings_tokens(model, draft):
    """Lookup's drafts are certain: a row keeps one while plain sampling's own draw (its seed,
    its step) is that draft, so the text is plain sampling's, at any batch size."""
    context, doc = document(model, 150)
    hot = [SamplingParams(temperature=0.6, top_k=2, seed=i) for i in range(6)]
    reqs = [
        Request(f"q{i}", tuple(ids(5 + 3 * i, 60 + i)), p, max_tokens=120, context=context)
        for i, p in enumerate(hot)
    ]
    for batch, rows in ((6, reqs), (1, reqs[:2])):
        plain = generate(model, rows, doc, batch)
        spec = generate(model, rows, doc, batch, draft)
        assert {k: g.tokens for k, g in spec.items()} == {k: g.tokens for k, g in plain.items()}
        if draft == "lookup":
            assert sum(g.accepted_tokens for g in spec.values()) > 0, batch


def test_greedy_speculation_on_the_gpu_path(model, monkeypatch):
    """The GPU path's compiled decode step beside the verify pass's graphs."""
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    context, doc = document(model, 150)
    reqs = [Request(f"q{i}", tuple(ids(9, i)), max_tokens=160, context=context) for i in range(4)]
    plain = generate(model, reqs, doc, 4)
    for draft in ("lookup", "layers"):
        spec = generate(model, reqs, doc, 4, draft, tokens=6)
        assert {k: g.tokens for k, g in spec.items()} == {k: g.tokens for k, g in plain.items()}


def test_greedy_speculation_on_the_gpu_path_over_unrelated_prompts(model, monkeypatch):
    """Pooled short documents, no shared prefix: a verify pass's rows end at different lengths
    over their own keys only, and each is masked as its own (on the GPU path)."""
    monkeypatch.setenv("SALABATCH_GPU_PATH", "1")
    lengths = (5, 40, 17, 90)
    reqs = [Request(f"q{i}", tuple(ids(n, i)), max_tokens=60) for i, n in enumerate(lengths)]
    plain = generate(model, reqs, None, 4)
    for draft in ("lookup", "layers"):
        spec = generate(model, reqs, None, 4, draft, tokens=4)
        assert {k: g.tokens for k, g in spec.items()} == {k: g.tokens for k, g in plain.items()}
        assert sum(g.accepted_tokens for g in spec.values()) > 0, draft


def test_stop_tokens_and_max_tokens_end_speculating_rows_as_plain_ones(model):
    context, doc = document(model, 150)
    free = Request("free", tuple(ids(4, 3)), max_tokens=80, context=context)
    tokens = generate(model, [free], doc, 1)["free"].tokens
    stop = frozenset({tokens[30]})  # a token the answer reaches mid-way
    reqs = [
        Request("stop", free.prompt, max_tokens=80, stop=stop, context=context),
        Request("short", free.prompt, max_tokens=13, context=context),
    ]
    plain = generate(model, reqs, doc, 2)
    spec = generate(model, reqs, doc, 2, "layers")
    for r in reqs:
        assert spec[r.id].tokens == plain[r.id].tokens
        assert spec[r.id].finish_reason == plain[r.id].finish_reason
    assert spec["short"].finish_reason == "length" and len(spec["short"].tokens) == 13


def test_lookup_runs_plain_steps_while_it_finds_no_draft(model, monkeypatch):
    """A step that found no draft read its token before building the next step (not
    pipelined); after it, `lookup` runs plain (pipelined) steps, asking its drafter after each
    token read, and verifies drafts again once it finds one. Tokens as plain decoding's."""
    context, doc = document(model, 150)
    req = Request("q", tuple(ids(9, 1)), max_tokens=60, context=context)
    plain = generate(model, [req], doc, 1)["q"].tokens

    def propose(self, row, limit):  # nothing for the answer's first 20 tokens, then a guess
        return [] if len(row.own) - row.prompt < 20 else [7] * limit

    monkeypatch.setattr(Lookup, "propose", propose)
    passes = []  # the answer's length at each step that reads first (drafting or not)
    step = Batch._speculative_step

    def reading_first(self):
        passes.append(len(self.rows[0].tokens))
        return step(self)

    monkeypatch.setattr(Batch, "_speculative_step", reading_first)
    got = generate(model, [req], doc, 1, "lookup")["q"]
    assert got.tokens == plain
    assert passes[0] == 0  # the first step looked for a draft and found none
    assert len(passes) > 1 and min(passes[1:]) >= 20  # plain steps until there was one
    assert got.draft_tokens > 0


def test_builtin_model_answers_the_demo_questions_identically():
    path = resolve_model("builtin:tiny")
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    text = "Services Agreement between Redwater Robotics (the Provider) and Acme Mills. " * 3
    context = tuple(tok.document_prompt(text, system=None, think=False))
    doc = model.make_cache()
    prefill(model, context, doc)
    questions = ["Give the service provider of this agreement.", "Tell me the Client."]
    stop = frozenset(tok.eos_ids)
    reqs = [
        Request(q, tuple(tok.prompt_suffix(q, system=None, think=False)), SamplingParams(), 24,
                stop, context=context)
        for q in questions
    ]  # fmt: skip
    plain = generate(model, reqs, doc, 2)
    spec = generate(model, reqs, doc, 2, "lookup")
    assert {k: g.tokens for k, g in spec.items()} == {k: g.tokens for k, g in plain.items()}


# -- rejection sampling ---------------------------------------------------------------------------
def _emitted(verdicts, drafts):
    """The first two tokens each row emits: its accepted drafts, then the model's token."""
    out = []
    for v, d in zip(verdicts, drafts, strict=True):
        tokens = list(d[: v.accepted]) + [v.next_token]
        out.append(tokens[:2])
    return out


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


@pytest.mark.parametrize("drafter", ["lookup", "layers"])
def test_rejection_sampling_keeps_the_distribution_of_plain_sampling(drafter):
    """Drafts accepted with min(1, p/q) and residual draws leave each emitted token distributed
    as plain sampling's: the first by p0, the second (after the first draft) by p1."""
    N, V = 6000, 6
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(3, V)).astype(np.float32) * 1.5
    logits = mx.broadcast_to(mx.array(raw)[None], (N, 3, V))
    p = np.exp(raw) / np.exp(raw).sum(axis=1, keepdims=True)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    q = None
    if drafter == "lookup":
        drafts = [[int(np.argsort(p[0])[-2]), 2]] * N  # the second likeliest: often rejected
    else:
        qd = np.full((2, V), 1.0 / V)  # the draft model: uniform, its drafts drawn from it
        drafts = rng.integers(0, V, size=(N, 2)).tolist()
        q = mx.broadcast_to(mx.array(qd, dtype=mx.float32)[None], (N, 2, V))
    first = sample_tokens(logits[:, 0], params, [0] * N)
    emitted = _emitted(verify(logits, drafts, params, [0] * N, first, q), drafts)
    firsts = np.bincount([e[0] for e in emitted], minlength=V)
    assert _tv(firsts, p[0]) < 0.025
    seconds = [e[1] for e, d in zip(emitted, drafts, strict=True) if len(e) > 1 and e[0] == d[0]]
    assert len(seconds) > 800  # the first draft was accepted that often: the second follows p1
    assert _tv(np.bincount(seconds, minlength=V), p[1]) < 0.05


def _same_distribution(a: list, b: list) -> bool:
    """Two-sample chi-square test of the samples a and b (equal sizes) at the 0.1 % level,
    categories seen fewer than 10 times pooled; the critical value by Wilson-Hilferty."""
    support = sorted(set(a) | set(b), key=str)
    ca = np.array([a.count(t) for t in support], dtype=float)
    cb = np.array([b.count(t) for t in support], dtype=float)
    rare = ca + cb < 10
    if rare.any():
        ca = np.append(ca[~rare], ca[rare].sum())
        cb = np.append(cb[~rare], cb[rare].sum())
    both = ca + cb
    stat = float((((ca - cb) ** 2) / both).sum())  # equal sample sizes: Σ (a - b)² / (a + b)
    df = len(both) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * np.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def test_sampled_speculation_matches_plain_sampling_in_distribution(model):
    """Through the whole model: sampled answers (top-3) drafted by the first layers against plain
    sampling's, by a two-sample test of their first two tokens together and of the next two."""
    context, doc = document(model, 150)
    prompt = tuple(ids(6, 5))
    hot = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(960)]
    reqs = [Request(f"s{i}", prompt, p, 4, context=context) for i, p in enumerate(hot)]
    plain = generate(model, reqs, doc, 96)
    spec = generate(model, reqs, doc, 96, "layers", tokens=3)
    assert sum(g.accepted_tokens for g in spec.values()) > 0
    for part in (slice(0, 2), slice(2, 3), slice(3, 4)):
        a = [tuple(plain[r.id].tokens[part]) for r in reqs]
        b = [tuple(spec[r.id].tokens[part]) for r in reqs]
        assert _same_distribution(a, b), part


# -- the drafters and the policy ------------------------------------------------------------------
def test_lookup_copies_what_followed_the_answer_in_the_document():
    doc = (5, 6, 7, 8, 9, 10, 11, 3, 5, 6, 12)
    row = RowText(doc, [40, 41, 6, 7])  # the answer ends with "6 7": the document has "6 7 8 9"
    assert Lookup().propose(row, 3) == [8, 9, 10]
    row = RowText(doc, [40, 9])  # one token alone: its continuation there
    assert Lookup().propose(row, 2) == [10, 11]
    # a lone token found twice: where the document's words are the prompt's
    filler = tuple(range(100, 140))  # more than a window apart
    doc = (70, 71, 72, 5, 6, 7, *filler, 80, 81, 82, 5, 9, 9)
    assert Lookup().propose(RowText(doc, [81, 90, 5]), 2) == [9, 9]
    assert Lookup().propose(RowText(doc, [71, 90, 5]), 2) == [6, 7]
    # ... and where no place stands out from the others, no guess
    doc = (70, 71, 72, 5, 6, 7, *filler, 70, 71, 72, 5, 9, 9)
    assert Lookup().propose(RowText(doc, [71, 90, 5]), 2) == []
    row = RowText((), [1, 2, 3, 1, 2, 3, 1, 2])  # a repeat continues into its own draft
    assert Lookup().propose(row, 5) == [3, 1, 2, 3, 1]
    assert Lookup().propose(RowText(doc, [99, 98]), 4) == []


def test_auto_backs_off_where_passes_do_not_pay_and_grows_where_they_do():
    policy = Policy(Speculation("auto", tokens=4))
    plain = [policy.speculate() for _ in range(Policy.WARMUP)]
    assert plain == [False] * Policy.WARMUP  # measures plain steps first
    policy.plain_step(8, 0.0)
    policy.plain_step(8, 0.010)  # 10 ms a plain step for 8 rows: 800 tokens/s
    assert policy.speculate() and policy.tokens == 4  # then probes with its full length
    policy.verify_pass(8, 9, 0.02)  # 450 tokens/s: worse, and a probe backs off at once
    assert policy.tokens == 0
    waits = 0
    while not policy.speculate():
        waits += 1
    assert waits == Policy.BACKOFF + 1  # the first plain step after a pass is not timed
    assert policy.tokens == 4
    policy.verify_pass(8, 24, 0.012)  # 2,000 tokens/s: the probe pays
    for _ in range(2):  # 90 tokens/s: the average falls behind, one draft less (no back-off)
        policy.verify_pass(8, 9, 0.1)
    assert policy.tokens == 3
    for _ in range(3):
        policy.verify_pass(8, 24, 0.012)  # 2,000 tokens/s
    assert policy.tokens == 4
    for _ in range(5):  # accepting nothing never pays, however fast a noisy clock says it was
        policy.verify_pass(8, 8, 0.001)
    assert policy.tokens == 3
    policy.verify_pass(8, 24, 0.5)  # slow: behind plain steps
    assert policy.tokens == 2
    for _ in range(Policy.REMEASURE):  # and every REMEASURE passes, plain steps of now
        if not policy.tokens:
            break
        policy.verify_pass(8, 24, 0.012)
    assert policy.tokens == 0 and not policy.speculate()
    stats = RowStats()
    for _ in range(3):
        stats.passed(4, 0)
    assert stats.rate < Policy.ROW_FLOOR
    assert sum(policy.drafts_for(stats) for _ in range(16)) == 16 // Policy.PROBE


def test_auto_rests_where_no_row_has_anything_to_draft():
    """A probe that finds no draft in any row ran unpipelined for nothing: `auto` runs plain
    steps, twice as many each time, until a row joins or a draft is found; `lookup` runs plain
    steps until then."""
    policy = Policy(Speculation("auto", tokens=4))
    while not policy.speculate():
        pass
    for rest in (Policy.BACKOFF, 2 * Policy.BACKOFF):
        policy.undrafted()
        waits = 0
        while not policy.speculate():
            waits += 1
        assert waits == rest + 1
    policy.undrafted()
    assert not policy.speculate()
    policy.joined()
    assert policy.speculate() and policy.tokens == 4
    policy.joined()  # (while passes run, a join changes nothing)
    assert policy.speculate() and policy.tokens == 4
    fixed = Policy(Speculation("lookup", tokens=4))
    fixed.undrafted()  # `lookup`: plain (pipelined) steps until its drafter finds a draft
    assert fixed.awaits_draft and not fixed.speculate() and not fixed.speculate()
    fixed.draftable()
    assert not fixed.awaits_draft and fixed.speculate() and fixed.tokens == 4
    fixed.undrafted()
    fixed.joined()  # or a row joins
    assert fixed.speculate() and fixed.tokens == 4
    policy.undrafted()  # `auto` resting likewise asks its drafter after each plain step
    assert policy.awaits_draft and not policy.speculate()
    policy.draftable()
    assert policy.speculate() and policy.tokens == 4
    layers = Policy(Speculation("layers", tokens=4))
    layers.undrafted()  # (no room to draft: nothing to wait for)
    assert not layers.awaits_draft and layers.speculate()


def test_fixed_drafters_always_draft_their_tokens():
    policy = Policy(Speculation("lookup", tokens=5))
    assert policy.speculate() and policy.tokens == 5
    policy.verify_pass(8, 1, 10.0)
    assert policy.tokens == 5


def test_speculation_settings_are_checked():
    with pytest.raises(ValueError, match="draft must be one of"):
        Speculation("sometimes")
    with pytest.raises(ValueError, match="≥ 1"):
        Speculation("lookup", tokens=0)


# -- the golden configs ---------------------------------------------------------------------------
def test_no_divergence_on_the_golden_configs(golden_dir):
    """The independent reference's config and weights (float32): each case's prompt (its
    document prefilled once) answered greedily for 120 tokens with every drafter, as plain
    decoding answers it: the divergence rate the issue asks measured, 0 of every token."""
    import json

    model = load_model(golden_dir, dtype="float32")
    cases = json.loads((golden_dir / "golden_manifest.json").read_text())["cases"]
    for name, case in cases.items():
        ids = mx.load(str(golden_dir / case["file"]))["input_ids"].tolist()[: case["prompt_len"]]
        doc = model.make_cache()
        prefill(model, ids[:-1], doc)
        reqs = [Request(name, tuple(ids[-1:]), max_tokens=120, context=tuple(ids[:-1]))]
        plain = generate(model, reqs, doc, 1)[name]
        for draft in ("lookup", "layers"):
            spec = generate(model, reqs, doc, 1, draft, tokens=4, layers=2)[name]
            assert spec.tokens == plain.tokens, (draft, name)
            assert spec.draft_tokens > 0


def test_a_long_lived_batch_drops_each_documents_index_with_its_last_row(model):
    """The server's decoding group lives while rows overlap and makes a new context tuple for
    every request: each document's index must leave with its last row (it kept them all, a
    document's tuple and n-gram arrays a request, until the group emptied)."""
    import time

    batch = Batch(model, forked=False, speculation=Speculation("lookup", 3))

    def join(rid: str, context: tuple[int, ...], max_tokens: int):
        req = Request(rid, tuple(ids(5, len(rid))), max_tokens=max_tokens, context=context)
        cache = model.make_cache()
        logits = prefill(model, req.prompt, cache)
        return batch.add(req, cache, logits, admitted=time.perf_counter())

    long = join("long", tuple(ids(50, 7)), 60)
    shared = tuple(ids(40, 8))  # two rows of one document: it stays until both have left
    for i in range(6):
        rows = [join(f"s{i}", tuple(ids(40, 100 + i)), 2)]
        rows += [join(f"t{i}a", shared, 1 + i % 2), join(f"t{i}b", shared, 2)]
        while not all(g.done for g in rows):
            batch.step()
        batch.step()  # the finished rows leave
        assert not long.done
        assert set(batch._lookup._contexts) == {id(long.request.context)}
    while not long.done:
        batch.step()
    batch.step()
    assert not batch._lookup._contexts and not batch._lookup._rows
