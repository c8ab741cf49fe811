"""Serving: the engine (one model, continuous batching, prefix reuse) and what talks to it."""
