"""Small run configs for tests that drive the training loop in this process, and a snapshot of
a directory for tests that check a command left files alone."""

from pathlib import Path

ONE_LAYER = [
    "model.n_layers=1",
    "model.hidden=32",
    "model.n_heads=2",
    "model.vocab_size=500",
    "model.seq_len=16",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=1000",  # more than any test's steps: never evaluates
    "logging.progress=false",
]
"""The smallest model that trains: for tests of the loop's behaviour, not its numbers."""

TWO_LAYERS = [
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_interval=1000",
    "train.precision=fp32",
    "train.device=cpu",
    "logging.progress=false",
]
"""Two layers, so that checkpoints hold several layers' tensors."""


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime (ns)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }
