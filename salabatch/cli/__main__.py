"""`python -m salabatch.cli`: the `salabatch` command."""

from salabatch.cli import main

main()
