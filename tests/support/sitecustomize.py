"""Imported by Python at the start of every process that has this folder on PYTHONPATH (the
tests' subprocesses: `megalite.testing.subprocess_hooks.environment`): installs the test hooks
that MEGALITE_TEST_HOOKS names before any megalite code runs."""

import os

if os.environ.get("MEGALITE_TEST_HOOKS"):
    from megalite.testing.subprocess_hooks import install

    install(os.environ["MEGALITE_TEST_HOOKS"])
