"""`megalite <command>`: train, generate, export-hf, data, estimate, plan, profile, plot. Launch
training (and profile) on several processes with `torchrun --nproc-per-node N -m megalite train`.

Every MegaliteError (bad config, bad data, bad checkpoint, impossible layout) is printed as one
`error: ...` line with exit code 2, instead of a traceback; under torchrun once for the job
(`errors.report_error`). A collective that fails because a peer died is one line too, naming
this rank and the call, with exit code 1 (a crash); a hang ends with 124 (the watchdog), a
preemption with 75.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from megalite.commands import data as data_commands
from megalite.commands import estimate as estimate_command
from megalite.commands import non_negative_float, non_negative_int
from megalite.commands import plan as plan_command
from megalite.commands import plot as plot_command
from megalite.commands import profile as profile_command
from megalite.errors import MegaliteError, print_line, report_error


def _train(args: argparse.Namespace) -> int:
    from megalite.config import load_config

    cfg = load_config(args.config, args.overrides)  # checked before torch is even imported
    from megalite.comm_trace import CollectiveError
    from megalite.training.loop import train

    try:
        train(cfg)  # ends with its summary line (or says there was nothing left to train)
    except CollectiveError as failure:  # a peer died or timed out: its rank says why, not us
        print_line(f"error: {str(failure).splitlines()[0]}")
        return CRASH_EXIT_CODE
    return 0


CRASH_EXIT_CODE = 1
"""A rank whose collective failed under it (a peer crashed): what Python exits with on an
uncaught error, distinct from a hang (124), a bad input (2) and a preemption (75)."""


def _leave_world() -> bool:
    """Destroy the process group before the interpreter exits, on success and on error alike:
    left to the interpreter's teardown, gloo's threads were seen to abort a rank that lost the
    out_dir lock race ("terminate called without an active exception", exit -6) after it had
    printed its error."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def _generate(args: argparse.Namespace) -> int:
    from megalite.generate import sample_text

    text = sample_text(
        Path(args.checkpoint),
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
    )
    print(text)
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from megalite.checkpoint.hf import export_hf

    out = export_hf(Path(args.checkpoint), Path(args.out), args.dtype)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


CHECKPOINT_HELP = (
    "a run directory (train.out_dir), its checkpoints/ directory or checkpoints/latest file "
    "(each meaning the newest complete checkpoint), or a checkpoints/step_* directory"
)


class _Parser(argparse.ArgumentParser):
    """A usage error once for the job: under torchrun every rank parses the same command line,
    so global rank 0 prints it and the others exit with the same code, silently."""

    def error(self, message: str) -> NoReturn:
        if int(os.environ.get("RANK", 0)) == 0:
            super().error(message)
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megalite", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = commands.add_parser("train", help="train a model from a YAML config")
    train.add_argument("--config", help="YAML config (see configs/); defaults when omitted")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="e.g. train.steps=50 parallel.tp=2",
    )
    train.set_defaults(func=_train)

    gen = commands.add_parser("generate", help="sample text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    gen.add_argument("--prompt", default="", help="text to continue")
    gen.add_argument("--max-new-tokens", type=non_negative_int, default=64)
    gen.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 means greedy")
    gen.add_argument(
        "--top-k",
        type=non_negative_int,
        default=50,
        help="sample among the k likeliest tokens (0: all of them)",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)

    export = commands.add_parser(
        "export-hf", help="write a checkpoint as a Hugging Face model directory"
    )
    export.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    export.add_argument("--out", required=True, help="the directory to create")
    export.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="of the written weights"
    )
    export.set_defaults(func=_export_hf)

    data_commands.register(commands)
    profile_command.register(commands)
    estimate_command.register(commands)
    plan_command.register(commands)
    plot_command.register(commands)
    return parser


def parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    """The command's arguments. Overrides may stand between options, as in `megalite profile
    --config c.yaml parallel.pp=2 --steps 3 train.out_dir=x`: argparse takes only the first
    run of them as the positional, and the later ones come back unrecognised."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    later_overrides = [arg for arg in rest if "=" in arg and not arg.startswith("-")]
    if rest and hasattr(args, "overrides") and later_overrides == rest:
        args.overrides = [*(args.overrides or []), *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    code, _ = _run(argv)
    return code


def _run(argv: list[str] | None) -> tuple[int, bool]:
    """The command's exit code, and whether this process had joined a distributed world."""
    args = parse_command_line(argv)
    try:
        code = args.func(args)
    except MegaliteError as exc:
        report_error(exc)
        code = 2
    except SystemExit as stop:  # a preemption (75): through entry_point's exit like any code
        code = stop.code
    finally:
        joined = _leave_world()
    return code, joined


def entry_point() -> None:
    """`megalite` and `python -m megalite` (torchrun's workers): after a distributed command the
    process ends at once (`os._exit`), its output flushed. Why: left to the interpreter's
    teardown, a C++ thread of the backends still joinable at static destruction aborted a rank
    that had finished cleanly ("terminate called without an active exception", exit -6), about
    once in a few hundred torchrun workers here, failing a job that had saved everything."""
    code, joined = _run(None)
    if joined:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry_point()
