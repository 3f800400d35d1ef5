"""Estimate the memory of one GPU of a training run (first pipeline stage, the fullest one):
16-bit parameters, fp32 gradients, fp32 master weights and Adam state (sharded by ZeRO-1), and
activations (Korthikanti et al. 2022, times the micro-batches the schedule keeps in flight,
taken from the pipeline simulator).

    python tools/estimate_memory.py --config configs/llama-7b.yaml --world-size 32
    python tools/estimate_memory.py --config configs/gpt2-1.3b.yaml --world-size 8 \
        train.recompute=none
"""

import argparse

from megalite.config import load_config
from megalite.profiling.memory import estimate, first_stage_params, in_flight_microbatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    dp, m = cfg.layout_for_world(args.world_size)
    params = first_stage_params(cfg, args.world_size)
    parts = estimate(cfg, args.world_size, params)
    p, t = cfg.parallel, cfg.train
    print(
        f"layout tp={p.tp} pp={p.pp} vpp={p.vpp} dp={dp} sp={p.sp} zero={p.zero} "
        f"schedule={p.schedule} recompute={t.recompute}; {m} micro-batches of {t.micro_batch_size}"
    )
    print(
        f"parameters on the first stage's rank: {params / 1e6:,.1f} M; "
        f"micro-batches in flight there: {in_flight_microbatches(cfg, dp):.2f}"
    )
    print(f"{'part':<14}{'GiB':>10}")
    for name, value in parts.items():
        print(f"{name:<14}{value / 2**30:>10.2f}")
    print(f"{'total':<14}{sum(parts.values()) / 2**30:>10.2f}")


if __name__ == "__main__":
    main()
