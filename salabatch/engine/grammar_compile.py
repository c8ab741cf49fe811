"""A pattern's token index (outlines-core's `Index`), compiled in a child process bounded in time
and memory.

Compiling turns the pattern into an automaton over the vocabulary's tokens, and some small
patterns take exponential time and memory: a JSON schema `{"type": "array", "minItems": 4}`
took 72 s and 3 GB on a 1,024-token vocabulary, and larger counts made outlines-core ask for
8 GB blocks, whose failure aborts the process. A server compiles what its clients send, so the
compile runs in a child interpreter (`python -m` this module: no MLX, none of the parent's
threads or code) that is killed past `seconds`, its address space capped at `max_bytes` where
the system enforces the cap (Linux; macOS ignores it, and the time bound holds there alone).
The pattern and vocabulary go to it pickled on its standard input, the index comes back so on
its standard output.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import subprocess
import sys
from pathlib import Path

from outlines_core import Index, Vocabulary

COMPILE_SECONDS = 60.0  # the longest a pattern may compile ("any JSON object": ~5 s at 57K)
COMPILE_BYTES = 8 * 2**30  # the address space a compile may take

_OUT_OF_MEMORY = 3  # the child's exit status for a MemoryError (an abort is SIGABRT's)
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds the package


class CompileError(Exception):
    """Why a pattern has no index: outlines-core refused it, or its compile went past a bound."""


def compile_index(
    pattern: str,
    vocabulary: Vocabulary,
    seconds: float = COMPILE_SECONDS,
    max_bytes: int = COMPILE_BYTES,
) -> Index:
    """`Index(pattern, vocabulary)`, compiled in a child process; CompileError saying why not."""
    env = dict(os.environ)  # the child finds this package where the parent found it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    child = subprocess.Popen(
        [sys.executable, "-m", __name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        out, err = child.communicate(pickle.dumps((pattern, vocabulary, max_bytes)), seconds)
    except subprocess.TimeoutExpired:
        raise CompileError(f"compiling it took over {seconds:g} s: simplify the pattern") from None
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    if child.returncode in (-signal.SIGABRT, _OUT_OF_MEMORY):  # an allocation past max_bytes
        gb = max_bytes / 2**30
        raise CompileError(f"compiling it took over {gb:g} GB: simplify the pattern")
    if child.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise CompileError(f"its compile failed (exit status {child.returncode}: {last})")
    ok, value = pickle.loads(out)  # noqa: S301 (our own child's answer)
    if not ok:
        raise CompileError(value)
    return value


def _child() -> None:
    """The child: caps its address space, compiles, writes (True, index) or (False, why)."""
    pattern, vocabulary, max_bytes = pickle.load(sys.stdin.buffer)  # noqa: S301 (our parent's)
    with contextlib.suppress(ValueError, OSError):  # a system that refuses the cap: the time
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))  # bound holds alone
    try:
        result = (True, Index(pattern, vocabulary))
    except (ValueError, TypeError, RuntimeError) as e:
        result = (False, str(e))
    except MemoryError:
        sys.exit(_OUT_OF_MEMORY)
    sys.stdout.buffer.write(pickle.dumps(result))


if __name__ == "__main__":
    _child()
