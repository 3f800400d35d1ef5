"""Benchmarks of megalite against PyTorch's own parallelism, Hugging Face transformers and eager
kernels, as library functions: the `tools/bench_*.py` scripts are thin callers, and an installed
megalite (which has no `tools/`) runs each as `python -m megalite.benchmarks.<name>`.

`tp`, `pp`, `zero`, `single` and `init` split their `main(argv)` into `options()` (the argparse
parser), `run(args)` (measure; returns plain, picklable rows) and `report(args, result)` (print
the table), so other commands can measure without printing. The shared pieces: `harness`
(options, batches, megalite's side, interleaved timing), `torch_gpt` (the plain PyTorch twin of
megalite's GPT, AdamW as megalite's) and `table` (the printed table and its common notes). The
ranks come from `megalite.launch`, the launcher the multi-process tests use.
"""
