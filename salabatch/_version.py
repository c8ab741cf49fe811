"""The package's version, below everything: the engine, the results file and the CLI read it
without going through `salabatch/__init__`, whose API attributes import the engine."""

__version__ = "0.1.0"
