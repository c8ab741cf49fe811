"""salabatch: batch question answering over long documents with MiniCPM-SALA on Apple MLX."""

__version__ = "0.1.0"
