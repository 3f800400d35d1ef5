"""Data parallelism with a sharded optimizer, dp=2 on two gloo ranks: megalite ZeRO-1 against
PyTorch DDP + `torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`, and megalite ZeRO-3
against PyTorch FSDP2 (`fully_shard` on each block, then the model).

Both train the same GPT-2-style model on the same global batches (each rank takes its half
and runs m micro-batches of gradient accumulation; torch skips DDP's all-reduce with
`no_sync()` on all but the last; FSDP2 and ZeRO-3 reduce-scatter every micro-batch's
gradients), clip at 1.0 and take an AdamW step on their shard of the optimizer state. Two
unsharded rows (megalite zero=0, DDP + plain AdamW) show what sharding costs and saves;
`--no-baselines` leaves them out.

    python tools/bench_zero.py                       # forks its 2 ranks itself
    python tools/bench_zero.py --microbatches 4 --no-baselines
    torchrun --nproc-per-node 2 tools/bench_zero.py  # same, launched by torchrun
    python -m megalite.benchmarks.zero               # the same, from an installed megalite

Optimizer memory per rank, counted from the tensors the optimizers hold:
- "state": Adam's exp_avg + exp_avg_sq, plus megalite's fp32 master copy of its owned
  elements where it is a tensor of its own: only for bf16/fp16 parameters (fp32 parameters are
  their own master), so at fp32 both hold 8 bytes per owned element (the "B/elem" column) and
  12 with 16-bit parameters; "state w/o master" is megalite's count without the master.
- "all": every tensor the optimizer keeps beyond the model's own storage and its gradients
  (torch's per-parameter `step` scalars come on top).
- "owned": parameter elements whose optimizer state the rank holds (megalite pads each gradient
  bucket to a multiple of dp and gives every rank an equal piece; ZeroRedundancyOptimizer
  assigns whole parameters to ranks, so its pieces can be uneven). Both ranks are shown; the
  memory columns are those of the rank with the most state.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from megalite.benchmarks import harness
from megalite.benchmarks.table import COMMON_COLUMNS, common_cells, common_notes, print_table
from megalite.benchmarks.torch_gpt import TorchGPT, lm_loss, torch_adamw
from megalite.launch import run_or_join
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.training.setup import Run

DP = 2
MB = 2**20


def megalite_memory(training: Run) -> dict[str, int]:
    """Bytes of megalite's optimizer tensors on this rank. "elements": owned elements; "master":
    the fp32 master copy, when it is a tensor of its own (an unsharded fp32 run steps the
    parameters in place); "state": master + exp_avg + exp_avg_sq; "all": every tensor of the
    shard states that is not model storage or gradients."""
    optimizer = training.optimizer
    seen = {  # the model's (ZeRO-3: its owned pieces)
        t.untyped_storage().data_ptr() for b in optimizer.buffers for t in b.param_tensors()
    }

    def own_bytes(t: torch.Tensor) -> int:
        """Size of t, unless its storage is the model's or was already counted."""
        if not torch.is_tensor(t) or t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.numel() * t.element_size()

    states = optimizer.states
    master = sum(own_bytes(s.master) for s in states)
    moments = sum(own_bytes(s.exp_avg) + own_bytes(s.exp_avg_sq) for s in states)
    # the reduce-scattered gradient piece is gradient memory (torch's DDP buckets are not
    # counted either), so it is left out
    rest = sum(own_bytes(v) for s in states for k, v in vars(s).items() if k != "grads")
    return {
        "elements": sum(s.exp_avg.numel() for s in states),
        "master": master,
        "state": master + moments,
        "all": master + moments + rest,
    }


def megalite_contender(args: argparse.Namespace, ps: ParallelState, zero: int) -> harness.Contender:
    training = harness.megalite_run(harness.parallel_config(args, DP, tp=1, pp=1, zero=zero), ps)
    info = megalite_memory(training)
    return harness.Contender(
        f"megalite zero={zero}", harness.megalite_step(training, args.lr), info=info
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: an FSDP2 state tensor is a DTensor over the whole parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


def torch_memory(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> dict[str, int]:
    """Elements with state, bytes of exp_avg + exp_avg_sq, and bytes of every state tensor, of
    this rank's pieces."""
    state = [
        {k: _local(v) for k, v in optimizer.state[p].items()}
        for p in params
        if p in optimizer.state
    ]
    return {
        "elements": sum(s["exp_avg"].numel() for s in state),
        "state": sum(
            s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq")
        ),
        "all": sum(
            t.numel() * t.element_size() for s in state for t in s.values() if torch.is_tensor(t)
        ),
        "master": 0,
    }


TORCH_KINDS = {
    "ddp": "torch DDP + AdamW",
    "ddp-zero": "torch DDP + ZeroRedundancyOptimizer",
    "fsdp2": "torch FSDP2 (fully_shard)",
}
"""torch's contenders, by kind."""


def torch_model(args: argparse.Namespace, kind: str) -> nn.Module:
    """The model as `kind` wraps it: DDP, or FSDP2 sharding each block and then the rest."""
    model = TorchGPT(args)
    if kind != "fsdp2":
        return DistributedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def torch_contender(args: argparse.Namespace, kind: str) -> harness.Contender:
    model = torch_model(args, kind)
    params = list(model.parameters())
    optimizer = torch_adamw(params, args.lr, args.torch_adamw, kind == "ddp-zero")
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    per_rank = harness.global_batch(args, DP) // DP

    def accumulating(last: bool) -> contextlib.AbstractContextManager:
        """DDP all-reduces only the last micro-batch's gradients; FSDP2 reduce-scatters each."""
        return contextlib.nullcontext() if last or kind == "fsdp2" else model.no_sync()

    def step(tokens: torch.Tensor) -> dict[str, float]:
        mine = tokens[dist.get_rank() * per_rank : (dist.get_rank() + 1) * per_rank]
        optimizer.zero_grad(set_to_none=True)
        chunks = mine.split(args.micro_batch)
        total = torch.zeros(())
        for i, chunk in enumerate(chunks):
            with accumulating(i == len(chunks) - 1):
                loss = lm_loss(model(chunk[:, :-1]), chunk[:, 1:]) / len(chunks)
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        dist.all_reduce(total)  # the global batch's mean loss, as megalite reports it
        return {"loss": total.item() / DP}

    contender = harness.Contender(TORCH_KINDS[kind], step)
    contender.info["memory_of"] = (local, params)
    return contender


def worker(args: argparse.Namespace) -> dict:
    """One rank's part: build every contender, time them interleaved, gather both ranks'
    optimizer memory, return the rows."""
    torch.manual_seed(args.seed)
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    batches = harness.make_batches(args, args.warmup + args.steps, harness.global_batch(args, DP))
    pairs = [(1, "ddp-zero"), (3, "fsdp2")] + ([(0, "ddp")] if args.baselines else [])
    contenders = []
    for zero, kind in pairs:
        torch_row = torch_contender(args, kind)
        megalite = megalite_contender(args, ps, zero)
        megalite.reference = torch_row.name
        contenders += [torch_row, megalite]
    harness.measure(contenders, batches, args.warmup)
    for c in contenders:  # torch's state exists only after a step
        if "memory_of" in c.info:
            c.info = torch_memory(*c.info.pop("memory_of"))
    per_rank = [None] * DP
    dist.all_gather_object(per_rank, [c.info for c in contenders])
    rows = harness.summary(contenders, harness.global_batch(args, DP) * args.seq)
    for i, row in enumerate(rows):
        row["ranks"] = [infos[i] for infos in per_rank]
    return {"rows": rows}


def memory_cells(row: dict, rows: list[dict]) -> list[str]:
    """Largest rank's optimizer memory and its breakdown per owned element."""
    worst = max(row["ranks"], key=lambda info: info["state"])
    ref = next((r for r in rows if r["name"] == row["reference"]), None)
    ratio = "ref"
    if ref is not None:
        ref_state = max(info["state"] for info in ref["ranks"])
        ratio = f"{worst['state'] / ref_state:.2f}"
    owned = " / ".join(f"{info['elements']:,}" for info in row["ranks"])
    return [
        f"{worst['state'] / MB:.2f}",
        ratio,
        f"{(worst['state'] - worst['master']) / MB:.2f}",
        f"{worst['all'] / MB:.2f}",
        owned,
        f"{worst['state'] / worst['elements']:.1f}",
    ]


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    parser = harness.options(__doc__.split("\n\n")[0], microbatches=2)
    parser.add_argument(
        "--no-baselines",
        dest="baselines",
        action="store_false",
        help="leave out the unsharded rows (megalite zero=0, DDP + AdamW)",
    )
    return parser


def run(args: argparse.Namespace) -> dict | None:
    """Measure on DP gloo ranks: {"rows": [...]} (None on the ranks other than 0 under
    torchrun)."""
    return run_or_join(DP, worker, args, timeout=args.timeout)


def report(args: argparse.Namespace, result: dict) -> None:
    """Print the table of `run`'s result."""
    rows = result["rows"]
    table = [common_cells(r, rows) + memory_cells(r, rows) for r in rows]
    columns = COMMON_COLUMNS + [
        "state MB",
        "mem ratio m/t",
        "state w/o master MB",
        "all MB",
        "owned elems r0 / r1",
        "B/elem",
    ]
    notes = common_notes(args, DP, harness.global_batch(args, DP) * args.seq)
    notes += [
        "memory columns: optimizer tensors of the rank with the most state (see the docstring); "
        "mem ratio m/t = megalite state / torch state (<= 1.00: megalite no larger).",
        "state = exp_avg + exp_avg_sq + a separate fp32 master copy if any (megalite keeps one "
        "only for 16-bit params); all = state + anything else the optimizer keeps beyond the "
        "model's params and grads (torch: its step scalars).",
    ]
    print_table(columns, table, notes)


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
