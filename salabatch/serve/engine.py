"""The serving engine: one model on its own thread, continuous batching of the requests that
arrive, prefix reuse across requests. The HTTP server (`salabatch.serve.app`) and the terminal
chat (`salabatch chat`) talk to it only through `ServeEngine.submit` and the `Ticket` it returns.

A job goes: the queue (bounded: `QueueFull` past `max_queue` waiting) → its prefill → a row of a
decoding group → its last event. All MLX work runs on the engine thread, which loops:

1. takes waiting jobs while fewer than `batch_size` are prefilling or decoding;
2. feeds about one chunk (`prefill_chunk` tokens) of the oldest jobs still prefilling, so a
   long prompt never stops the others' decoding for more than a chunk, and many short ones
   join at once;
3. steps every decoding group once (`generate.Batch`, pipelined), so every running job advances.

Jobs taken together whose rows fork one held prefix and whose own tokens are short (one chunk,
no snapshot to take, interactive) prefill together: their own tokens right-padded into one call
on n forks of the prefix, each row then rolled back to exactly its tokens
(`generate.prefill_forks`; a job alone takes the same path, a batch of one: its plain prefill).
Padding is kept small by batching similar lengths (`padded_batches`). Other jobs prefill on
their own row, a chunk per turn.

Prefix reuse (`prefixes.HeldPrefixes`): a job resumes from the longest held prefix its prompt
starts with (memory, then the prefix store on disk): its row is a fork of it, and it prefills the
rest. Rows forking one held prefix share its keys and decode as one group (16 clients asking
questions of one document are one batch); rows that fork nothing (short prompts) decode as one
group of their own, their caches joined; each other prefix is a group, and the groups are stepped
in turn. `batch_size` bounds the rows of all groups together (and the jobs prefilling): it is the
memory the rows may take, whatever their prefixes.

Snapshots (the prefixes held): while prefilling, a job keeps its cache at each of its
`boundaries`, where its prompt starts as a recent one did (`prefixes.SeenPrompts`), and at the
end of its prompt that lies at least `snapshot_min` tokens (default 256) past where it resumed
or its last snapshot: a shorter segment costs less to prefill again than to hold. A
conversation's next turn re-sends the prompt, the answer and a new question, so it resumes at
the last snapshot and prefills only what came after (at most `snapshot_min` tokens more than its
own). A job that resumed from nothing snapshots its own cache (no copy) and goes on
from a fork of it; a job on a fork pays one copy of the prefix per snapshot (`prefixes.owned`).
Memory for held prefixes is capped at `prefix_bytes`; the least recently used go to the store,
and `close()` writes the rest there. A job that scores its prompt (`Job.prompt_logprobs`) holds
its snapshots with its scores so far, and resumes only from a prefix held so (memory only).

Every job ends with one Finished (stop, length, cancelled) or Failed (it could not run: its error
names it; the others go on). `close()` ends what is left with Failed(EngineClosed).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from salabatch.engine.sampling import SamplingParams, TokenLogprob, narrow_rows, read_rows
from salabatch.engine.speculative import OFF, Speculation
from salabatch.errors import CacheWarning, SalabatchError, error_text
from salabatch.serve.prefixes import Held, HeldPrefixes, SeenPrompts, owned, prefix_digests

if TYPE_CHECKING:
    import mlx.core as mx

    from salabatch.engine.cache import ModelCache
    from salabatch.engine.generate import Batch, Generation
    from salabatch.engine.grammar import Grammar
    from salabatch.engine.memory import MemoryPlan

SNAPSHOT_MIN = 256  # tokens a snapshot must lie past the last one (or where the job resumed)
# Background jobs' prefill chunk while interactive jobs are about (INTERACTIVE_S since the last
# one prefilled or decoded): an interactive job arriving waits for at most one such chunk.
BACKGROUND_CHUNK = 64
INTERACTIVE_S = 30.0
# positions reserved past a group's longest row when rows join: a row's buffers grow with its
# answer from there (max_tokens may be the whole context, which a row rarely fills)
RESERVE_AHEAD = 1024
# Padded batches of own prompts (`padded_batches`): padding at most this share of the real
# tokens, or at most PAD_FREE tokens in all (a short batch pads freely: one call less is worth
# more than a few padded positions)
PAD_SHARE = 0.25
PAD_FREE = 16
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds


# What `ServeEngine.stats()` holds. Counters, since the engine was made:
COUNTERS = (
    "requests_total",  # accepted by submit
    "requests_rejected_total",  # QueueFull
    "requests_finished_total",  # stop or length
    "requests_cancelled_total",
    "requests_failed_total",
    "prompt_tokens_total",  # of the jobs that started
    "cached_tokens_total",  # prompt tokens resumed from a held prefix
    "prefill_tokens_total",  # prompt tokens prefilled
    "completion_tokens_total",
    "draft_tokens_total",  # tokens drafted (speculative decoding)
    "accepted_tokens_total",  # drafted tokens accepted
    "prefix_hits_memory_total",
    "prefix_hits_disk_total",
    "prefix_misses_total",
    "prefix_evictions_total",  # held prefixes evicted to the cap (stored, where there is a store)
)
GAUGES = (
    "queue_depth",  # jobs waiting
    "prefilling",  # jobs taken, prefilling
    "running_rows",  # rows decoding, all groups
    "decode_groups",  # groups (a held prefix's forks, or the rows without one)
    "prefix_held_bytes",  # memory of the held prefixes: ≤ prefix_cap_bytes
    "prefix_held_count",
    "prefix_lent_bytes",  # evicted prefixes running rows still read (freed with them)
    "prefix_cap_bytes",
)
HISTOGRAMS = (
    "ttft_seconds",  # submit to first token
    "decode_step_seconds",  # one step of one group
    "queue_seconds",  # submit to the start of its prefill (waiting for a row)
)


class QueueFull(SalabatchError):
    """More requests are waiting than the engine's queue holds (HTTP 429)."""


class EngineClosed(SalabatchError):
    """The engine is shutting down or has stopped after an error (HTTP 503)."""


class JobFailed(SalabatchError):
    """A job the engine could not run (its prompt does not fit the model, its prefill ran out
    of memory, ...); the message names the job, `cause` is the error behind it (a
    SalabatchError such as OutOfMemoryError, or any other), `job_id` the job."""

    def __init__(self, job_id: str, cause: BaseException) -> None:
        self.job_id, self.cause = job_id, cause
        why = str(cause) if isinstance(cause, SalabatchError) else error_text(cause)
        super().__init__(f"job {job_id}: {type(cause).__name__}: {why}")


@dataclass(frozen=True)
class Job:
    """One completion. `prompt` is the whole prompt's token ids, rendered by the caller (chat
    template, document, earlier turns); the engine finds the longest prefix of it it already
    holds. `boundaries`: token offsets inside the prompt where a reusable prefix ends (the end of
    each message, say, so that requests sharing a system message with a document share its
    prefill); the end of the prompt is always one. Generation stops at `max_tokens` or at the
    model's context, whichever comes first. `background`: a job no one waits on (a batch's
    line): interactive jobs are admitted and prefilled before it, and its prefill goes in
    `background_chunk` pieces, so an interactive job never waits behind more than one.
    `logprobs`: None, or each token's log-probability with its k most likely alternatives'
    (`Request.logprobs`), on its Token events. `grammar`: what the answer must match
    (`salabatch.engine.grammar`). `prompt_logprobs`: None, or the prompt's tokens after the
    first scored the same way, in one PromptLogprobs event before the answer's; such a job
    resumes only from a prefix held with its scores (a scoring job's snapshot, in memory: each
    token's score needs its position's logits) and may have `max_tokens` 0 (it then only
    scores). `continues`: a text completion, whose answer's text is what it adds to the
    prompt's (`Request.after`), not decoded alone as a chat answer is."""

    id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stop: frozenset[int]  # stop token ids (end of turn, eos)
    stop_strings: tuple[str, ...] = ()
    boundaries: tuple[int, ...] = ()
    background: bool = False
    logprobs: int | None = None
    grammar: Grammar | None = field(default=None, repr=False, compare=False)
    prompt_logprobs: int | None = None
    continues: bool = False  # a text completion: its answer's text continues the prompt's


@dataclass(frozen=True)
class Token:
    """A token of the answer (never a stop token); `logprob` where its job asked for them."""

    token: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """The log-probability of each prompt token after the first, given those before it (a job
    with `prompt_logprobs`; before its first Token)."""

    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    """The last event of a job. finish_reason: "stop", "length" or "cancelled". `text` is the
    answer cut before the stop string that ended it, where a stop string did (else None)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from a prefix the engine held (memory or disk)
    text: str | None
    queued_s: float  # from submit to the start of its prefill
    prefill_s: float
    ttft_s: float  # from submit to its first token
    decode_s: float
    cache_source: str = "none"  # where its cached tokens came from: "memory" | "disk" | "none"
    draft_tokens: int = 0  # tokens drafted for it (speculative decoding)
    accepted_tokens: int = 0  # of those, accepted


@dataclass(frozen=True)
class Failed:
    """The last event of a job that could not run (the error names why)."""

    error: SalabatchError


Event = Token | PromptLogprobs | Finished | Failed


class Ticket:
    """A submitted job: its events in order, ending with one Finished or Failed. Iterate it once,
    with `for` (blocking) or `async for` (on the loop given to `submit`), or call `next_event`;
    leaving the loop before the last event cancels the job. `prefilled`: how many of its prompt's
    tokens its cache holds so far (resumed, then prefilled chunk by chunk), for a caller showing
    a long prefill's progress."""

    def __init__(
        self, job: Job, loop: asyncio.AbstractEventLoop | None, wake: Callable[[], None]
    ) -> None:
        self.job = job
        self._loop, self._wake = loop, wake
        self._events: deque[Event] = deque()
        self._cond = threading.Condition()
        self._ready = asyncio.Event()  # bound to `loop` at its first wait, set only there
        self._cancelled = False
        self._ended = False  # the last event was put
        self._begun = False  # the engine has begun it: it fits (`Engine._begin`)
        self.prefilled = 0  # set by the engine's thread

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stops the job at the engine's next step (thread-safe; a no-op once finished); a
        Finished("cancelled") follows."""
        if not self._ended and not self._cancelled:
            self._cancelled = True
            self._wake()

    def __aiter__(self) -> AsyncIterator[Event]:
        """Events on the event loop given to `submit`."""
        if self._loop is None:
            raise RuntimeError("submit(job, loop) with an event loop to iterate on it")
        return self._async_events()

    def __iter__(self) -> Iterator[Event]:
        """Events, blocking (for a caller without an event loop: `submit(job)` with no loop)."""
        last = False
        try:
            while not last:
                event = self.next_event()
                last = isinstance(event, Finished | Failed)
                yield event
        finally:
            if not last:
                self.cancel()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, blocking up to `timeout` seconds (None: until there is one); None
        when none came in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout):
                return None
            return self._events.popleft()

    def _began(self) -> None:
        """From the engine thread: the job passed its checks (`first_failure`)."""
        self._begun = True
        self._wake_reader()

    async def _async_events(self) -> AsyncIterator[Event]:
        last = False
        try:
            while not last:
                self._ready.clear()
                with self._cond:
                    event = self._events.popleft() if self._events else None
                if event is None:
                    await self._ready.wait()  # set after the engine puts an event
                    continue
                last = isinstance(event, Finished | Failed)
                yield event
        finally:
            if not last:
                self.cancel()

    def _put(self, event: Event) -> bool:
        """From the engine thread; False when the caller's event loop is closed (no one can
        read it: the engine then cancels the job)."""
        with self._cond:
            self._events.append(event)
            self._ended = isinstance(event, Finished | Failed)
            self._cond.notify_all()
        return self._wake_reader()

    def _wake_reader(self) -> bool:
        """From the engine thread: wakes a reader on the caller's event loop; False when that
        loop is closed."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is closed
                return False
        return True


async def first_failure(tickets: Sequence[Ticket], timeout: float) -> Failed | None:
    """On the loop given to `submit`, before iterating the tickets: waits up to `timeout`
    seconds while the engine checks their jobs (their length, their memory) → the Failed of
    the first it fails, left first in its line to be read. None, without waiting longer, once
    every job is begun or any ticket has an event to send (a choice decoding while another
    waits for a row must not be held back), or when the time is up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for ticket in tickets:
            ticket._ready.clear()  # before looking: a wake after the look is not lost
        firsts = []
        for ticket in tickets:
            with ticket._cond:
                firsts.append(ticket._events[0] if ticket._events else None)
        if failed := next((e for e in firsts if isinstance(e, Failed)), None):
            return failed
        left = deadline - loop.time()
        if any(e is not None for e in firsts) or all(t._begun for t in tickets) or left <= 0:
            return None
        waits = [asyncio.ensure_future(t._ready.wait()) for t in tickets]
        try:
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


@dataclass(eq=False)
class _Work:
    """A job inside the engine: its ticket, times, and where it is."""

    ticket: Ticket
    rid: str  # the engine's own id for it (jobs' ids need not be unique)
    submitted: float
    started: float = 0.0  # its prefill began
    first_at: float = 0.0  # its first token was put
    cached: int = 0
    source: str = "none"
    base: Held | None = None  # the held prefix its row forks
    points: list[int] | None = None  # where it snapshots (`save_points`), once begun
    max_tokens: int = 0  # what it may generate (max_tokens cut at the context), once begun
    needs: MemoryPlan | None = None  # what its prefill may take (`_check_memory`), once begun
    steps: Iterator[int] | None = None  # its prefill on its own row, a chunk per next()
    scored: list[np.ndarray] | None = None  # its prompt's scores so far, in order (`Prefill`)
    g: Generation | None = None
    batch: Batch | None = None
    emitted: int = 0  # tokens put as events


class Histogram:
    """Prometheus-style: cumulative counts of observations ≤ each bound, their sum and count."""

    def __init__(self, name: str, bounds: tuple[float, ...]) -> None:
        self.name, self.bounds = name, bounds
        self.counts = [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def items(self) -> dict[str, float]:
        pairs = zip(self.bounds, self.counts, strict=True)
        out = {f"{self.name}_bucket_{b:g}": float(c) for b, c in pairs}
        out[f"{self.name}_bucket_+Inf"] = float(self.count)
        out[f"{self.name}_sum"] = self.sum
        out[f"{self.name}_count"] = float(self.count)
        return out


@dataclass
class _Stats:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(HISTOGRAMS[0], TTFT_BUCKETS))
    step: Histogram = field(default_factory=lambda: Histogram(HISTOGRAMS[1], STEP_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(HISTOGRAMS[2], TTFT_BUCKETS))

    def add(self, name: str, n: float = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


class ServeEngine:
    """Owns the model. `start()` runs the engine thread; `submit` may be called from any thread.

    batch_size: rows decoding together at most (all groups) and jobs prefilling; max_queue:
    jobs waiting beyond those (QueueFull past it); prefix_bytes: memory for held prefixes (least
    recently used go to the prefix store on disk, if there is one, else are dropped); store_dir:
    that store (`salabatch run`'s cache dir shares its documents), of at most `store_gb`;
    snapshot_min: see the module docstring; model_sha: the model's fingerprint for the store's
    keys (default: computed from `model.path`, memoized in the store); background_chunk: the
    prefill chunk of background jobs while interactive jobs are about (default 64 tokens);
    speculation: how the groups draft (speculative decoding; off by default)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 8,
        max_queue: int = 64,
        prefill_chunk: int = 2048,
        prefix_bytes: int = 2 << 30,
        store_dir: str | Path | None = None,
        store_gb: float = 50.0,
        snapshot_min: int = SNAPSHOT_MIN,
        model_sha: str | None = None,
        background_chunk: int | None = None,
        speculation: Speculation = OFF,
    ) -> None:
        if batch_size < 1 or max_queue < 0 or prefill_chunk < 1 or prefix_bytes < 0:
            raise ValueError(
                "batch_size and prefill_chunk must be ≥ 1, max_queue and prefix_bytes ≥ 0"
            )
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_queue = batch_size, max_queue
        self.prefill_chunk, self.prefix_bytes = prefill_chunk, prefix_bytes
        self.background_chunk = min(prefill_chunk, background_chunk or BACKGROUND_CHUNK)
        self.store_dir = None if store_dir is None else Path(store_dir).expanduser()
        self.store_gb, self.snapshot_min, self.model_sha = store_gb, snapshot_min, model_sha
        self.speculation = speculation
        self._cv = threading.Condition()
        self._queue: deque[_Work] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._stopped_why = "the engine is closed"
        self._count = 0  # jobs submitted: their engine ids
        self._stats = _Stats()
        self._stats_lock = threading.Lock()
        # engine thread only:
        self._prefixes: HeldPrefixes | None = None
        self._seen = SeenPrompts()
        self._admitting: list[_Work] = []
        self._groups: dict[int | None, Batch] = {}  # by id of the rows' shared keys
        self._running: dict[str, _Work] = {}  # by rid: jobs with a row in a group
        # engine time on background prefill and on steps with interactive rows, while there are
        # such rows (`_serve` keeps the first within the second)
        self._background_s = self._interactive_s = 0.0
        self._interactive_at = -math.inf  # when an interactive job was last prefilling or decoding

    # -- the callers' side ---------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread (once; a second call does nothing)."""
        with self._cv:
            if self._closing:
                raise EngineClosed(self._stopped_why)
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="salabatch-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Cancels what is queued or running (each gets Failed(EngineClosed)), writes the held
        prefixes the store lacks to it (with a `store_dir`: a restarted server finds them) and
        joins the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        else:
            self._end_all(EngineClosed(self._stopped_why))

    def __enter__(self) -> ServeEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop | None = None) -> Ticket:
        """Queues `job` and returns at once (thread-safe). Events go to `loop` (thread-safe
        calls: nothing blocks it) for `async for`, else to a blocking `for`. QueueFull when
        `max_queue` jobs are waiting already; EngineClosed after `close()`."""
        return self.submit_all([job], loop)[0]

    def submit_all(
        self, jobs: Sequence[Job], loop: asyncio.AbstractEventLoop | None = None
    ) -> list[Ticket]:
        """`submit` of the jobs of one request (its n choices) together: each queued, or, where
        the queue cannot take them all, none (QueueFull): no choice of a refused request runs
        or holds a place."""
        tickets = [Ticket(job, loop, self._wake) for job in jobs]
        with self._cv:
            if self._closing:
                raise EngineClosed(self._stopped_why)
            # the queued jobs that free rows take at the next step are not waiting (< 0: this
            # job has a row too)
            waiting = len(self._queue) - (
                self.batch_size - len(self._admitting) - len(self._running)
            )
            if waiting + len(jobs) - 1 >= self.max_queue:
                self._stat("requests_rejected_total")
                raise QueueFull(
                    f"{max(waiting, 0)} requests are waiting for a row (max_queue "
                    f"{self.max_queue}): no room for {len(jobs)} more; retry later"
                )
            for ticket in tickets:
                self._count += 1
                self._queue.append(_Work(ticket, f"#{self._count}", time.perf_counter()))
                self._stat("requests_total")
            self._cv.notify_all()
        return tickets

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics: requests, prompt/completion/cached tokens, queue
        depth, running rows, prefix hits (memory, disk) and misses, held prefix bytes, and the
        TTFT, decode-step and queue-time histograms (as `{name}_bucket_{le}` counts, `_sum`,
        `_count`). The names are `COUNTERS`, `GAUGES` and `HISTOGRAMS`."""
        with self._stats_lock:
            out = dict.fromkeys((*COUNTERS, *GAUGES), 0.0)
            out |= {k: float(v) for k, v in self._stats.counters.items()}
            out |= self._stats.gauges | self._stats.ttft.items() | self._stats.step.items()
            out |= self._stats.queue.items()
        out["queue_depth"] = float(len(self._queue))
        out["prefix_cap_bytes"] = float(self.prefix_bytes)
        return out

    def check(self, job: Job) -> None:
        """JobFailed if the engine would refuse `job` before any work (an empty prompt, ids
        outside the vocabulary, a prompt that fills the context, max_tokens out of range, an
        empty stop string): for a caller that answers those before it starts a stream.
        Thread-safe, no MLX; the engine checks again anyway."""
        try:
            self._check(job)
        except ValueError as e:
            raise JobFailed(job.id, e) from e

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _stat(self, name: str, n: float = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, n)

    # -- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        import mlx.core as mx

        from salabatch.engine.kernels.attention import on_gpu
        from salabatch.engine.memory import cache_limit
        from salabatch.engine.runtime import engine_runtime

        why = "the engine is closed"
        try:
            with engine_runtime(cache_limit(self.model.config, self.prefill_chunk, on_gpu())):
                self._prefixes = self._held_prefixes()
                self._serve()
                self._end_all(EngineClosed(why))  # the jobs first, then the prefixes to disk
                self._prefixes.flush()
        except BaseException as e:  # a fault of the engine itself: every job must still end
            why = f"the engine stopped: {type(e).__name__}: {error_text(e)}"
            warnings.warn(why, RuntimeWarning, stacklevel=1)
        finally:
            self._end_all(EngineClosed(why))
            mx.clear_streams()  # what MLX asks of a thread that ran MLX work

    def _held_prefixes(self) -> HeldPrefixes:
        """The held prefixes, over the prefix store where there is one and the model's
        fingerprint can be had (else memory only, with a warning)."""
        from salabatch.engine.fingerprint import model_fingerprint
        from salabatch.engine.runtime import dtype_name
        from salabatch.jobs.store.prefix_store import PrefixKey, PrefixStore

        cfg = self.model.config
        if self.store_dir is None:
            return HeldPrefixes(self.prefix_bytes, cfg)
        path = getattr(self.model, "path", None)
        try:
            sha = self.model_sha or model_fingerprint(
                path, memo=self.store_dir / "fingerprints.json"
            )
            tok_sha = self.tokenizer.fingerprint
        except (OSError, TypeError, AttributeError) as e:
            warnings.warn(
                f"{self.store_dir}: prefixes are held in memory only: the model or tokenizer "
                f"has no fingerprint ({error_text(e)})",
                CacheWarning,
                stacklevel=2,
            )
            return HeldPrefixes(self.prefix_bytes, cfg)
        name, dtype = str(path or "model"), dtype_name(self.model.dtype)

        def key(ids_sha: str, tokens: int) -> PrefixKey:
            return PrefixKey(name, sha, tok_sha, dtype, ids_sha, tokens, "served prefix")

        store = PrefixStore(self.store_dir, self.store_gb)
        return HeldPrefixes(self.prefix_bytes, cfg, store, key)

    def _serve(self) -> None:
        while True:
            with self._cv:
                if self._closing:
                    return
                self._drop_cancelled_queued()
                while self._queue and self._busy() < self.batch_size:
                    self._admitting.append(self._next_queued())
                if not self._admitting and not self._groups:
                    self._publish()
                    self._cv.wait()
                    continue
            self._sweep_cancelled()
            interactive = any(not w.ticket.job.background for w in self._running.values())
            if interactive or any(not w.ticket.job.background for w in self._admitting):
                self._interactive_at = time.perf_counter()
            if not interactive:
                self._background_s = self._interactive_s = 0.0
            start = time.perf_counter()
            # a row that just joined steps before the next background chunk: 0 < 0 is False
            self._advance(background=not interactive or self._background_s < self._interactive_s)
            self._background_s += time.perf_counter() - start
            start = time.perf_counter()
            for key, batch in list(self._groups.items()):
                self._step(key, batch)
            if interactive:
                self._interactive_s += time.perf_counter() - start
            self._publish()

    def _next_queued(self) -> _Work:
        """(Under the lock) the oldest interactive job waiting, else the oldest background one."""
        for w in self._queue:
            if not w.ticket.job.background:
                self._queue.remove(w)
                return w
        return self._queue.popleft()

    def _busy(self) -> int:
        return len(self._admitting) + sum(len(b) for b in self._groups.values())

    def _drop_cancelled_queued(self) -> None:
        """(Under the lock) ends the queued jobs that were cancelled."""
        if any(w.ticket.cancelled for w in self._queue):
            for w in [w for w in self._queue if w.ticket.cancelled]:
                self._queue.remove(w)
                self._finish(w, "cancelled")

    def _sweep_cancelled(self) -> None:
        """Ends cancelled jobs that are prefilling (after the chunk done) or decoding (their
        row leaves at its group's next step)."""
        for w in [w for w in self._admitting if w.ticket.cancelled]:
            self._admitting.remove(w)
            if w.steps is not None:
                w.steps.close()
            self._finish(w, "cancelled")
        for w in [w for w in self._running.values() if w.ticket.cancelled and not w.g.done]:
            w.batch.cancel(w.g)
            self._done(w)

    def _advance(self, background: bool = True) -> None:
        """About one chunk of prefill: the oldest jobs prefilling until `prefill_chunk` tokens
        are fed (many short prompts join at once, a long one takes a chunk per turn),
        interactive jobs first; a job whose prefill ends joins a group. Interactive jobs that
        have not begun are begun in order, and those that can prefill together do
        (`_admit_together`). A background job's chunk ends the turn: the groups step, the queue
        is looked at, between any two of its chunks; with `background` False none is fed
        (`_serve` keeps background prefill to at most half the engine's time while interactive
        rows decode)."""
        budget = self.prefill_chunk
        self._admitting.sort(key=lambda w: w.ticket.job.background)  # stable: oldest first
        while self._admitting and budget > 0:
            w = self._admitting[0]
            if w.ticket.job.background and not background:
                return
            background = background and w.ticket.job.background  # none after an interactive
            if w.points is None and not w.ticket.job.background:
                budget -= self._admit_together(budget)
                continue
            try:
                if w.steps is None:
                    if w.points is None:
                        self._begin(w)
                    w.steps = self._admission(w)
                fed = next(w.steps)
                budget = 0 if w.ticket.job.background and fed else budget - fed
            except StopIteration:
                self._admitting.pop(0)
            except Exception as e:
                self._admitting.pop(0)
                self._fail(w, e)

    def _chunk(self, job: Job) -> int:
        """The next prefill chunk of `job`: `prefill_chunk`, but `background_chunk` for a
        background job while interactive jobs came within INTERACTIVE_S (an interactive job
        arriving waits for the chunk in progress, so that chunk is kept short)."""
        recent = time.perf_counter() - self._interactive_at < INTERACTIVE_S
        return self.background_chunk if job.background and recent else self.prefill_chunk

    def _begin(self, w: _Work) -> None:
        """What w's prefill starts with: its checks (`_check`, `_check_memory`: JobFailed's
        causes), the longest held prefix its prompt starts with (acquired), its save points."""
        job = w.ticket.job
        w.started = time.perf_counter()
        w.max_tokens = self._check(job)
        w.base, w.source = self._prefixes.match(job.prompt, job.boundaries, job.prompt_logprobs)
        w.cached = 0 if w.base is None else w.base.tokens
        w.ticket.prefilled = w.cached
        agreed = self._seen.agreed(job.prompt)  # where it starts as a recent prompt did
        marks = (*job.boundaries, agreed) if agreed else job.boundaries
        w.points = save_points(w.cached, len(job.prompt), marks, self.snapshot_min)
        w.needs = self._check_memory(job, w.cached, w.points, w.max_tokens)
        w.ticket._began()

    def _joinable(self, w: _Work) -> bool:
        """Whether begun job w can prefill together with others (`_admit_together`): its row
        forks a held prefix, and what it adds is one interactive chunk with no snapshot and no
        score."""
        job = w.ticket.job
        own = len(job.prompt) - w.cached
        plain = not job.background and job.prompt_logprobs is None
        return w.base is not None and not w.points and plain and 0 < own <= self.prefill_chunk

    def _admit_together(self, budget: int) -> int:
        """Begins the interactive jobs at the head of the line that have not begun, oldest
        first, until about `budget` tokens or one that must prefill on its own row (it stays
        first in line, begun). Those that can (`_joinable`) prefill now, in padded batches of the
        forks of each held prefix (`padded_batches`, `prefill_forks`), and join its group.
        → the positions fed (padding included)."""
        taken: dict[int, list[_Work]] = {}  # by held prefix, oldest first
        total = 0
        while self._admitting and total < budget:
            w = self._admitting[0]
            if w.points is not None or w.ticket.job.background:
                break
            try:
                self._begin(w)
            except Exception as e:
                self._admitting.pop(0)
                self._fail(w, e)
                continue
            if not self._joinable(w):
                break
            self._admitting.pop(0)
            taken.setdefault(id(w.base), []).append(w)
            total += len(w.ticket.job.prompt) - w.cached
        from salabatch.engine import generate

        fed = 0
        dense_len = self.model.config.sparse.dense_len
        for ws in taken.values():
            held = ws[0].base
            rests = [w.ticket.job.prompt[held.tokens :] for w in ws]
            lengths = [len(r) for r in rests]
            for batch in padded_batches(lengths, self.prefill_chunk, dense_len - held.tokens):
                jobs = [ws[i] for i in batch]
                try:
                    rows = generate.prefill_forks(self.model, held.cache, [rests[i] for i in batch])
                except Exception as e:  # these jobs cannot run; the others can
                    for w in jobs:
                        self._fail(w, e)
                    continue
                fed += len(batch) * max(lengths[i] for i in batch)
                self._stat("prefill_tokens_total", sum(lengths[i] for i in batch))
                for w, (row, logits) in zip(jobs, rows, strict=True):
                    w.ticket.prefilled = len(w.ticket.job.prompt)
                    self._enter(w, row, logits)
        return fed

    def _admission(self, w: _Work) -> Iterator[int]:
        """Begun job w's prefill on its own row, one chunk per next() (→ the tokens it fed):
        resumes from its held prefix, snapshots at its save points (with its scores so far,
        where it scores its prompt), and ends with its row in a group."""
        import mlx.core as mx

        from salabatch.engine import memory
        from salabatch.engine.generate import Prefill

        job, model, points = w.ticket.job, self.model, w.points
        n, resumed, score = len(job.prompt), w.cached, job.prompt_logprobs
        digests = prefix_digests(job.prompt, points)
        # `row` is the job's cache: fresh (its own keys) until its first snapshot, else a fork
        row: ModelCache = model.make_cache() if w.base is None else w.base.cache.fork(1)
        logits = None if w.base is None else w.base.logits
        if score is not None:
            w.scored = [] if w.base is None else [narrow_rows(w.base.scores, score)]
        at = resumed
        for q in points if points and points[-1] == n else [*points, n]:
            if q > at:
                before = None if score is None or at == 0 else logits
                feed = Prefill(
                    model, job.prompt[at:q], row, self.prefill_chunk, score, before, planned=n
                )
                while not feed.finished:
                    feed.chunk = self._chunk(job)
                    done = feed.done
                    with memory.bounded(w.needs):  # the chunk's run-ahead within the job's plan
                        fed = feed.step() - done
                    w.ticket.prefilled = at + feed.done
                    self._stat("prefill_tokens_total", fed)
                    yield fed
                logits, at = feed.logits(), q
                mx.eval(logits)  # a snapshot keeps them: [vocab], not the graph behind them
                if score is not None:
                    w.scored.append(feed.score_rows())
            if q in points:
                held = dict(scores=None if score is None else np.concatenate(w.scored))
                if w.base is None:  # the row owns its keys: it is the snapshot, no copy
                    w.base = self._prefixes.hold(digests[q], q, row, logits, use=True, **held)
                    row = row.fork(1)
                else:
                    snapshot = owned(row, model.config)
                    self._prefixes.hold(digests[q], q, snapshot, logits, **held)
                yield 0
        self._enter(w, row, logits)

    def _enter(self, w: _Work, row: ModelCache, logits: mx.array) -> None:
        """w's prefilled row (one row; `logits` [vocab] of its prompt's last position) joins
        its group; its prompt's scores first, where it asked for them (a job that only scores
        ends there)."""
        from salabatch.engine.generate import Request

        job = w.ticket.job
        if w.scored is not None:
            rows = np.concatenate(w.scored)
            scores = read_rows(rows, job.prompt[1:], job.prompt_logprobs)
            w.ticket._put(PromptLogprobs(tuple(scores)))
            if w.max_tokens == 0:
                self._finish(w, "length", prefill_s=time.perf_counter() - w.started)
                return
        base = 0 if w.base is None else w.base.tokens
        request = Request(
            w.rid,
            job.prompt[base:],
            job.params,
            w.max_tokens,
            job.stop,
            job.stop_strings,
            context=job.prompt[:base],  # the held prefix's tokens, where lookup drafts search
            after=job.prompt if job.continues else (),
            logprobs=job.logprobs,
            grammar=job.grammar,
        )
        w.batch = self._group(row)
        w.g = w.batch.add(request, row, logits, cached_tokens=w.cached, admitted=w.started)
        self._running[w.rid] = w

    def _check(self, job: Job) -> int:
        """JobFailed's causes before any work: an empty prompt, ids outside the vocabulary, a
        prompt that fills the model's context, max_tokens < 1 (< 0 for a job that scores its
        prompt), an empty stop string, logprobs out of range. → the tokens the job may
        generate (max_tokens, cut at the context)."""
        from salabatch.engine.generate import answer_room
        from salabatch.engine.sampling import TOP_LOGPROBS

        cfg = self.model.config
        n = len(job.prompt)
        if n == 0:
            raise ValueError("the prompt has no tokens")
        least = 0 if job.prompt_logprobs is not None else 1
        if job.max_tokens < least:
            raise ValueError(f"max_tokens must be ≥ {least}, got {job.max_tokens}")
        bad = [t for t in job.prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        max_tokens = answer_room(cfg, n, job.max_tokens)  # the API's rule too
        if not all(job.stop_strings):
            raise ValueError("a stop string must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(job, name)
            if k is not None and not 0 <= k <= TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {TOP_LOGPROBS}], got {k}")
        return max_tokens

    def _check_memory(
        self, job: Job, resumed: int, points: list[int], max_tokens: int
    ) -> MemoryPlan:
        """What the job adds, unless it does not fit in the memory free (OutOfMemoryError): its
        new keys, its largest snapshot copy (a job on a fork copies its prefix at a snapshot),
        its row (as reserved when it joins) and a prefill chunk's temporaries (with the head's
        over its positions, where it scores its prompt)."""
        from salabatch.engine import memory
        from salabatch.engine.kernels.attention import on_gpu

        cfg, itemsize = self.model.config, self.model.dtype.size
        n = len(job.prompt)
        copies = points if resumed else points[1:]  # a fresh job's first snapshot is its cache
        tail = 2 * cfg.sparse.compression[1][1]
        chunk = min(self.prefill_chunk, n)
        max_tokens = min(max_tokens, RESERVE_AHEAD)  # reserved now; more as the answer grows
        plan = memory.MemoryPlan(
            weights=0,
            document=memory.document_bytes(cfg, n - resumed, itemsize)
            + (memory.document_bytes(cfg, max(copies), itemsize) if copies else 0),
            rows=memory.row_bytes(cfg, tail + n - resumed + max_tokens, itemsize),
            transient=memory.transient_bytes(cfg, chunk, on_gpu())
            + (memory.score_bytes(cfg, chunk) if job.prompt_logprobs is not None else 0),
            overshoot=memory.overshoot_bytes(cfg, chunk, on_gpu()),
        )
        memory.check(plan, advice=memory.ADVICE_SERVE)
        return plan

    def _group(self, row: ModelCache) -> Batch:
        """The decoding group a row joins: that of the rows holding the same shared keys (forks
        of one held prefix), or of the rows holding none."""
        from salabatch.engine.generate import Batch
        from salabatch.engine.sparse_cache import SparseKVCache

        shared = next((c.shared for c in row.layers if isinstance(c, SparseKVCache)), None)
        key = None if shared is None else id(shared)  # the rows keep `shared` alive
        if key not in self._groups:
            tok = self.tokenizer
            detok = getattr(tok, "detokenizer", None)
            self._groups[key] = Batch(
                self.model,
                forked=shared is not None,
                detokenizer=None
                if detok is None
                else lambda after: detok(skip_special=True, after=after),
                reserve_ahead=RESERVE_AHEAD,
                speculation=self.speculation,
            )
        return self._groups[key]

    def _step(self, key: int | None, batch: Batch) -> None:
        """One step of a group: its rows' tokens put as events, finished rows ended."""
        start = time.perf_counter()
        try:
            read = batch.step()
        except Exception as e:  # the group's rows cannot go on; the other groups can
            del self._groups[key]
            for w in [w for w in self._running.values() if w.batch is batch]:
                del self._running[w.rid]
                self._fail(w, e)
            return
        if read:
            with self._stats_lock:
                self._stats.step.observe(time.perf_counter() - start)
        for g in read:
            w = self._running[g.request.id]
            if not self._put_tokens(w):
                batch.cancel(g)
            if g.done:
                self._done(w)
        if not batch:
            del self._groups[key]

    def _put_tokens(self, w: _Work) -> bool:
        """Puts w's new tokens as events; False when its caller's loop is gone."""
        g, ok = w.g, True
        for i in range(w.emitted, len(g.tokens)):
            if not w.first_at:
                w.first_at = time.perf_counter()
            logprob = g.logprobs[i] if g.request.logprobs is not None else None
            ok = w.ticket._put(Token(g.tokens[i], logprob)) and ok
        w.emitted = len(g.tokens)
        return ok

    # -- ends ----------------------------------------------------------------------------------
    def _done(self, w: _Work) -> None:
        """w's row finished (or was cancelled): its Finished."""
        self._running.pop(w.rid, None)
        g = w.g
        self._finish(w, g.finish_reason, g.completion_tokens, g.text, g.prefill_s, g.decode_s)

    def _finish(
        self,
        w: _Work,
        reason: str,
        completion: int = 0,
        text: str | None = None,
        prefill_s: float = 0.0,
        decode_s: float = 0.0,
    ) -> None:
        now = time.perf_counter()
        job = w.ticket.job
        started = w.started or now
        ttft = (w.first_at or now) - w.submitted
        drafted, accepted = (0, 0) if w.g is None else (w.g.draft_tokens, w.g.accepted_tokens)
        event = Finished(
            finish_reason=reason,
            prompt_tokens=len(job.prompt),
            completion_tokens=completion,
            cached_tokens=w.cached,
            text=text,
            queued_s=started - w.submitted,
            prefill_s=prefill_s,
            ttft_s=ttft,
            decode_s=decode_s,
            cache_source=w.source,
            draft_tokens=drafted,
            accepted_tokens=accepted,
        )
        self._release(w)
        with self._stats_lock:
            s = self._stats
            s.add(
                "requests_cancelled_total" if reason == "cancelled" else "requests_finished_total"
            )
            s.add("completion_tokens_total", completion)
            s.add("draft_tokens_total", drafted)
            s.add("accepted_tokens_total", accepted)
            if w.started:
                s.add("prompt_tokens_total", len(job.prompt))
                s.add("cached_tokens_total", w.cached)
                s.queue.observe(event.queued_s)
            if completion:
                s.ttft.observe(ttft)
        w.ticket._put(event)

    def _fail(self, w: _Work, e: BaseException) -> None:
        self._release(w)
        self._stat("requests_failed_total")
        error = e if isinstance(e, EngineClosed) else JobFailed(w.ticket.job.id, e)
        w.ticket._put(Failed(error))

    def _release(self, w: _Work) -> None:
        if w.base is not None and self._prefixes is not None:
            self._prefixes.release(w.base)
            w.base = None

    def _end_all(self, error: EngineClosed) -> None:
        """Every job not ended yet ends with Failed(error); no job is accepted after."""
        with self._cv:
            self._closing = True
            self._stopped_why = error.message
            waiting = list(self._queue)
            self._queue.clear()
        for w in [*waiting, *self._admitting, *self._running.values()]:
            if w.steps is not None:
                w.steps.close()
            self._fail(w, error)
        self._admitting.clear()
        self._running.clear()
        self._groups.clear()
        self._publish()

    def _publish(self) -> None:
        """The gauges stats() reads, as the engine thread sees them now."""
        p = self._prefixes
        gauges = {
            "prefilling": float(len(self._admitting)),
            "running_rows": float(len(self._running)),
            "decode_groups": float(len(self._groups)),
        }
        if p is not None:
            gauges |= {
                "prefix_held_bytes": float(p.held_bytes),
                "prefix_held_count": float(len(p.held)),
                "prefix_lent_bytes": float(p.lent_bytes),
                "prefix_hits_memory_total": float(p.hits_memory),
                "prefix_hits_disk_total": float(p.hits_disk),
                "prefix_misses_total": float(p.misses),
                "prefix_evictions_total": float(p.evictions),
            }
        with self._stats_lock:
            self._stats.gauges = gauges


def save_points(start: int, end: int, boundaries: tuple[int, ...], minimum: int) -> list[int]:
    """Where a job whose prompt of `end` tokens resumes at `start` keeps snapshots: each of its
    boundaries, and its end, lying at least `minimum` tokens past the last snapshot (or
    `start`), in order."""
    out, last = [], start
    for q in sorted({b for b in boundaries if start < b < end} | {end}):
        if q - last >= minimum:
            out.append(q)
            last = q
    return out


def padded_batches(lengths: Sequence[int], cap: int, side: int) -> list[list[int]]:
    """Own prompts' lengths → batches of their indices, each prefilled as one call padded to
    its longest (`prefill_forks`), shortest first: a batch's rows × longest ≤ `cap` (a prefill
    chunk), its padding ≤ PAD_SHARE of its real tokens or ≤ PAD_FREE tokens, and its lengths
    all below `side` or all at or above it. `side`: dense_len less the prefix's length, the own
    length from which a row's sparse layers attend sparsely; a padded call decides for its
    longest row, so a shorter row must not be carried across."""
    out: list[list[int]] = []
    batch: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]
        if batch:
            padded, with_n = (len(batch) + 1) * n, real + n
            one_side = (lengths[batch[0]] >= side) == (n >= side)
            small = padded - with_n <= max(PAD_FREE, PAD_SHARE * with_n)
            if one_side and small and padded <= cap:
                batch.append(i)
                real = with_n
                continue
            out.append(batch)
        batch, real = [i], n
    if batch:
        out.append(batch)
    return out
