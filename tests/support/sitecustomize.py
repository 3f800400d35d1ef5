"""Imported by Python at the start of every process that has this folder on PYTHONPATH (the
tests' subprocesses: `megalite.testing.subprocess_hooks.environment`): arranges for the test
hooks that MEGALITE_TEST_HOOKS names to be installed as the modules they hook into load."""

import os

if os.environ.get("MEGALITE_TEST_HOOKS"):
    from megalite.testing.subprocess_hooks import install_on_import

    install_on_import(os.environ["MEGALITE_TEST_HOOKS"])
