"""Untrained demo models: `builtin:tiny` (builtin.py), its tokenizer (tokenizer.py) and the
random-weight checkpoints of tests and benchmarks (checkpoint.py). Their answers are noise; they
exist so that everything runs offline, anywhere."""
