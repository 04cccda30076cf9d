"""`python -m hf_vegas.tune ...` (see `hf_vegas.tune.cli`)."""

from .cli import main

main()
