"""`python -m megalite` and `torchrun -m megalite` run the CLI."""

from megalite.cli import entry_point

entry_point()
