"""`python -m megalite` and `torchrun -m megalite` run the CLI."""

import sys

from megalite.cli import main

sys.exit(main())
