"""Behaviour only tests ask for, injected by the tests, never imported by the trainer.

- `nccl_like`: gloo made to behave as NCCL does where the two differ (`megalite.nccl_contract`):
  one work per p2p batch, sends that complete only when matched, and each group's operations
  in issue order. `tests/conftest.py` installs it for the whole suite; forked ranks inherit it.
- `faults`: a checkpoint writer that stalls mid-save, so a test can kill it or train on.
- `subprocess_hooks`: how a test asks a `megalite` subprocess (the CLI, torchrun's workers)
  for either, through `tests/support/sitecustomize.py`.

`tests/unit/test_imports.py` checks that no other megalite module imports this package.
"""
