"""Training a small MiniCPM-SALA on synthetic long-document questions (`salabatch train`).

`data`: the deterministic task generator (train / eval splits); `train`: the training loop,
which imports MLX (import it only where training runs).
"""
