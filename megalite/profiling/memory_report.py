"""The printed memory estimate of one GPU of a training run (first pipeline stage, the fullest
one): 16-bit parameters, fp32 gradients, fp32 master weights and Adam state (sharded by ZeRO-1),
and activations (Korthikanti et al. 2022, times the micro-batches the schedule keeps in flight,
taken from the pipeline simulator).

    python tools/estimate_memory.py --config configs/llama-7b.yaml --world-size 32
    python tools/estimate_memory.py --config configs/gpt2-1.3b.yaml --world-size 8 \
        train.recompute=none
    python -m megalite.profiling.memory_report ...   # the same, from an installed megalite
"""

from __future__ import annotations

import argparse

from megalite.config import Config, load_config
from megalite.profiling.memory import estimate, first_stage_params, in_flight_microbatches


def memory_report(cfg: Config, world_size: int) -> str:
    """The layout, the first stage's parameters and micro-batches in flight, and a table of
    GiB per part with the total."""
    dp, m = cfg.layout_for_world(world_size)
    params = first_stage_params(cfg, world_size)
    parts = estimate(cfg, world_size, params)
    p, t = cfg.parallel, cfg.train
    lines = [
        f"layout tp={p.tp} pp={p.pp} vpp={p.vpp} dp={dp} sp={p.sp} zero={p.zero} "
        f"schedule={p.schedule} recompute={t.recompute}; {m} micro-batches of {t.micro_batch_size}",
        f"parameters on the first stage's rank: {params / 1e6:,.1f} M; "
        f"micro-batches in flight there: {in_flight_microbatches(cfg, dp):.2f}",
        f"{'part':<14}{'GiB':>10}",
    ]
    lines += [f"{name:<14}{value / 2**30:>10.2f}" for name, value in parts.items()]
    lines.append(f"{'total':<14}{sum(parts.values()) / 2**30:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    print(memory_report(load_config(args.config, args.overrides), args.world_size))


if __name__ == "__main__":
    main()
