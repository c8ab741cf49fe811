"""The builtin models (builtin.py): `builtin:tiny`, trained and shipped in `tiny/`, and
`builtin:random`; their tokenizer (tokenizer.py); the random-weight checkpoints of tests and
benchmarks (checkpoint.py). They exist so that everything runs offline, anywhere."""
