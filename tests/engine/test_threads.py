"""A model loaded on one thread runs on another, as in a server or a worker pool: prefill (dense
and sparse), decode across dense_len, and a batch over a shared prefix give the same numbers as
on the loading thread.

MLX binds an unevaluated op to the stream of the thread that made it, and since MLX 0.31.2 a
stream belongs to its thread, so any lazy array a model keeps (or a stream a kernel caches) fails
on another thread with "There is no Stream(cpu, N) in current thread".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx
import numpy as np
import pytest

from salabatch.engine.generate import Generator, Request, prefill
from salabatch.engine.load import load_model
from tests.tiny import SPARSE_AT_256, tiny_config_dict, write_tiny_checkpoint

T = TypeVar("T")


def on_thread(fn: Callable[[], T]) -> T:
    """fn() on a new thread; its result, or its exception raised here."""
    out: dict = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e
        finally:
            mx.clear_streams()  # what MLX asks of a thread that ran MLX work, before it ends

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def ids(n: int, seed: int) -> tuple[int, ...]:
    return tuple(np.random.default_rng(seed).integers(3, 256, size=n).tolist())


def work(model) -> dict:
    """Everything the engine does with a model; dense_len is 256 here."""
    out = {}
    cache = model.make_cache()
    out["sparse_prefill"] = np.array(prefill(model, ids(300, 1), cache, chunk=128))
    prefix = model.make_cache()
    prefill(model, ids(250, 2), prefix)
    # Rows start below dense_len and decode past it; one joins late (batch_size 2).
    requests = [Request(f"r{n}", ids(n, n), max_tokens=8) for n in (3, 9, 5)]
    done = Generator(model, batch_size=2).generate(requests, prefix)
    out["tokens"] = {g.request.id: g.tokens for g in done}
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("t"), tiny_config_dict(**SPARSE_AT_256))


def test_load_on_one_thread_run_on_others(checkpoint):
    # The reference runs first on this thread, so whatever it caches is this thread's.
    expected = work(load_model(checkpoint, dtype="float32"))
    model = on_thread(lambda: load_model(checkpoint, dtype="float32"))
    for _ in range(2):  # a second worker too: nothing may stay bound to the first
        got = on_thread(lambda: work(model))
        assert np.array_equal(got["sparse_prefill"], expected["sparse_prefill"])
        assert got["tokens"] == expected["tokens"]
    again = work(model)  # and back on this thread
    assert again["tokens"] == expected["tokens"]
