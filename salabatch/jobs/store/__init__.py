"""Prefix caches: a document is prefilled once. On disk, shared by runs and questions
(`prefix_store`); within a run, from the cheapest source: memory, the store, or a prefill resumed
from its last snapshot (`document_cache`)."""
