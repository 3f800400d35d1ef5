"""Checkpoints: the one module that knows the on-disk layout, and how a checkpoint is read.

    <out_dir>/checkpoints/
        latest                     text file naming the newest good complete checkpoint
        step_000100/
            manifest.json          layout, trainer state, where every tensor lies, checksums
            model_tp01_pp00.safetensors        parameters of one (tp, pp) rank (its dp rank 0)
            model_tp01_pp00_dp03.safetensors   ZeRO-3: the ranges of them that rank owns
            optim_tp01_pp00_dp03.safetensors   the Adam state that rank owns (ZeRO: 1/dp)
            rng_rank00003.safetensors          RNG streams of every rank
            tokenizer.model, or tokenizer.json (+ tokenizer_config.json)   the run's tokenizer

Tensors are stored under their global names (global layer indices). The manifest lists, for
each, the segments that make it up: (tp piece, flat element range within the piece, file, key).
A parameter is one segment per tp piece; its optimizer state is one segment per owned range, so
each rank writes exactly what it holds, with no gather over dp and host memory bounded by its
own shards. A checkpoint loads into any tp / pp / dp layout: segments are glued and cut as needed.
Files are named by the writing rank's coordinates on the grid's axes (`weights_file`,
`optimizer_file`); a reader finds them through the manifest, never by parsing a name.

Safety: everything is written under a temporary directory that is renamed into place only when
complete, then `latest` is replaced atomically (`writer.py`); files are safetensors and JSON (no
pickle); the manifest carries a checksum per block of every file (`files.py`) and one of its
own. A resuming rank reads only what it loads and verifies every block it reads; a missing or
damaged file is refused on every rank with a message naming it. A checkpoint saved as bad
(`"good": false`, during a bad-step streak) is kept but never resumed from automatically:
`latest` names the newest good one, and pruning keeps it.

Reading: `Checkpoint` is the read API every other module uses (its step, saved config,
tokenizer, weights, the one-process `model()`); `load_checkpoint` restores a whole `RunState`
for a resume.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megalite import comm
from megalite.checkpoint.files import CorruptFile, verify_file
from megalite.checkpoint.reader import CheckpointError, SavedTensors, corrupt
from megalite.checkpoint.state import RunState, routing_tensors
from megalite.config import ROPE_SCALING_KEYS, build_config
from megalite.data.tokenizer import HFTokenizer, Tokenizer, open_tokenizer
from megalite.models.causal_lm import CausalLM
from megalite.models.factory import build_chunks
from megalite.optimizer.distributed import STATE_KINDS
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom, global_tensors

FORMAT = "megalite-checkpoint-v4"
READABLE_FORMATS = (
    "megalite-checkpoint-v1",
    "megalite-checkpoint-v2",
    "megalite-checkpoint-v3",
    FORMAT,
)
"""v3 adds the manifest's own checksum (older ones are read without it); v4 checksums files
by block (`files.FileDigest`) and marks a checkpoint good or bad (absent: good)."""
CHECKSUMMED_FORMATS = READABLE_FORMATS[2:]
MANIFEST = "manifest.json"
LATEST = "latest"
UNFINISHED_SUFFIX = ".tmp"
"""A checkpoint is written under `step_N.tmp` and renamed to `step_N` once complete."""
MANIFEST_CHECKSUM = "manifest_sha256"
"""The manifest's key holding the sha256 of the rest of the manifest (`manifest_checksum`)."""

SHAPE_KEYS = (
    "arch",
    "n_layers",
    "hidden",
    "n_heads",
    "n_kv_heads",
    "ffn_hidden",
    "vocab_size",
    "max_positions",
)
"""The model settings that decide which tensors a checkpoint holds and their shapes."""

MOE_KEYS = ("moe_experts", "moe_top_k", "moe_router", "moe_shared_experts", "moe_routed_scale")
"""The routing a mixture-of-experts model's weights were trained under."""
MODEL_IDENTITY = (
    *SHAPE_KEYS,
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    *ROPE_SCALING_KEYS,
    *MOE_KEYS,
)
"""The model settings that change the function a checkpoint's weights compute: resuming with any
of them changed would reinterpret the weights (another head split, other rotary frequencies) or
silently drop some (fewer layers) whenever the tensor shapes happen to fit, so a resume refuses
it, and `checkpoint.init_from` a megalite checkpoint names the overrides."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def rng_file(rank: int) -> str:
    """The file holding the RNG streams of global rank `rank`."""
    return f"rng_rank{rank:05d}.safetensors"


def state_name(param_name: str, kind: str) -> str:
    """The global name one optimizer state of a parameter is stored under (`kind` in
    STATE_KINDS), e.g. `wte.weight.exp_avg`."""
    return f"{param_name}.{kind}"


def weights_file(dims: ParallelDims, rank: int) -> str:
    """The file of the weight pieces `rank` holds, named by its place on the axes that shard the
    weights (`model_tp01_pp00.safetensors`): one file per piece, written by one rank of it."""
    return f"model_{dims.label(rank, dims.weight_axes)}.safetensors"


def sharded_weights_file(dims: ParallelDims, rank: int) -> str:
    """Under ZeRO-3, the file of the weight ranges `rank` owns, named by its place on every
    axis (`model_tp01_pp00_dp03.safetensors`): each replica writes its own shard."""
    return f"model_{dims.label(rank, dims.naming_order)}.safetensors"


def optimizer_file(dims: ParallelDims, rank: int) -> str:
    """The file of the optimizer state `rank` owns, named by its place on every axis
    (`optim_tp01_pp00_dp03.safetensors`)."""
    return f"optim_{dims.label(rank, dims.naming_order)}.safetensors"


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """The sha256 of a manifest's canonical JSON without its own checksum key: an edited step
    number or file list no longer matches it."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: Path, verify_files: bool = True) -> dict[str, Any]:
    """Load a checkpoint's manifest and (verify_files) check every file's checksum; without it,
    each block is checked when read (`reader.SavedTensors`), so a rank verifies what it reads."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete megalite checkpoint (no manifest.json): "
            "point checkpoint.resume at a step_* directory written by megalite"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (not an object)")
    if manifest.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    if not {"files", "tensors", "trainer"} <= manifest.keys():
        raise CheckpointError(f"checkpoint {path} has a corrupt manifest.json (missing fields)")
    checksummed = manifest["format"] in CHECKSUMMED_FORMATS
    if checksummed and manifest.get(MANIFEST_CHECKSUM) != manifest_checksum(manifest):
        raise CheckpointError(
            f"{manifest_path} fails its checksum (edited or damaged): resume from an earlier "
            "checkpoint with checkpoint.resume=<dir>, or restore the file"
        )
    if verify_files:
        verify_files_of(path, manifest, list(manifest["files"]))
    return manifest


def verify_files_of(path: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """Check the files `names` of checkpoint `path` whole against the manifest."""
    for name in names:
        try:
            verify_file(path / name, manifest["files"][name])
        except CorruptFile as exc:
            raise corrupt(path, str(exc)) from None


def find_checkpoint(root: Path, resume: str) -> Path | None:
    """The checkpoint to resume from: none, the newest good one (auto, `newest_good_checkpoint`),
    or an explicit directory. Unfinished writes (`step_N.tmp`) are never resumed from; a step
    directory without its manifest, or checkpoints all marked bad, stop an auto-resume with an
    error that says what to do (resuming an older one silently would retrain and overwrite)."""
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
        return path
    if not root.is_dir():
        return None
    damaged = damaged_checkpoints(root)
    if damaged:
        raise CheckpointError(
            f"{damaged[-1]} has no manifest.json: it is not a complete checkpoint (damaged, or "
            f"copied in part). Move it out of {root}, or name the checkpoint to resume from with "
            "checkpoint.resume=<dir>"
        )
    newest = newest_good_checkpoint(root)
    complete = complete_checkpoints(root)
    if newest is None and complete:
        raise CheckpointError(
            f"{root} holds only checkpoints saved as bad (during a bad-step streak), the newest "
            f"{complete[-1].name}: resume one by name with checkpoint.resume=<dir>, or start "
            "afresh in another train.out_dir"
        )
    return newest


def _step_dirs(root: Path) -> list[Path]:
    steps = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    return sorted((p for p in steps if p.is_dir()), key=step_of)


def complete_checkpoints(root: Path) -> list[Path]:
    """The step directories under `root` that hold a manifest, by step."""
    return [p for p in _step_dirs(root) if (p / MANIFEST).is_file()]


def damaged_checkpoints(root: Path) -> list[Path]:
    """Step directories without a manifest: published once (only a complete checkpoint gets
    its step_N name) and damaged since; never resumed from, never pruned."""
    return [p for p in _step_dirs(root) if not (p / MANIFEST).is_file()]


def unfinished_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories whose writing never finished (a kill or preemption mid-save)."""
    return sorted(p for p in root.glob(f"step_*{UNFINISHED_SUFFIX}") if p.is_dir())


def step_of(path: Path) -> int:
    """The step of a `step_N` directory."""
    return int(path.name.removeprefix("step_"))


def is_good(path: Path) -> bool:
    """Whether the checkpoint at `path` was saved as good (older formats: always). A manifest
    that does not parse counts as good here: loading it gives the error that names it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(manifest, dict) or manifest.get("good", True) is not False


def latest_name(root: Path) -> str | None:
    """What the `latest` pointer under `root` names; None when there is none, or it is not
    text (damaged): the highest good step directory is found without it."""
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def newest_good_checkpoint(root: Path) -> Path | None:
    """The checkpoint a run continues from: the one `latest` names when it is complete and
    good, else the highest complete good step_* under `root`; None when there is none."""
    root = Path(root)
    name = latest_name(root)
    if name:
        named = root / name
        if (named / MANIFEST).is_file() and is_good(named):
            return named
    good = [p for p in reversed(complete_checkpoints(root)) if is_good(p)] if root.is_dir() else []
    return good[0] if good else None


def resolve_checkpoint(path: Path) -> Path:
    """The checkpoint a user means by `path`, so that `generate` and `export-hf` take whatever a
    run left behind: a step directory is itself; the `latest` pointer file, a `checkpoints/`
    directory or a run directory (train.out_dir) mean the newest good checkpoint there (a step
    directory without a manifest is skipped, with a note on stderr)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if path.is_file() and path.name == LATEST:
        root = path.parent
    elif (path / "checkpoints").is_dir():
        root = path / "checkpoints"
    else:
        root = path
    newest = newest_good_checkpoint(root) if root.is_dir() else None
    for damaged in damaged_checkpoints(root) if root.is_dir() else []:
        print(
            f"note: skipped {damaged}: no manifest.json (not a complete checkpoint)",
            file=sys.stderr,
        )
    if newest is None:
        found = "no complete megalite checkpoint" if path.exists() else "no such file or directory"
        if root.is_dir() and complete_checkpoints(root):
            found = "only checkpoints saved as bad (name one to use it)"
        raise CheckpointError(
            f"{path}: {found}; expected a run directory (train.out_dir), its checkpoints/ "
            "directory, the checkpoints/latest file, or a step_* directory with a manifest.json"
        )
    return newest


class Checkpoint:
    """A saved checkpoint opened for reading: the read API for every module that needs one
    (generation, export, `checkpoint.init_from`, resume, tests), so that none of them indexes the
    manifest. `path` is a step directory (`resolve_checkpoint` finds one from what a user
    typed). With `verify_files` every file's checksum is checked now; otherwise each block is
    checked when read."""

    def __init__(self, path: Path, verify_files: bool = True) -> None:
        self.path = Path(path)
        self._manifest = read_manifest(self.path, verify_files)
        self._files: dict[str, Any] = self._manifest["files"]
        self._tensors = SavedTensors(self.path, self._manifest)

    @property
    def step(self) -> int:
        """The step it was saved at."""
        step = self._manifest.get("step")
        if not isinstance(step, int):
            raise CheckpointError(f"checkpoint {self.path} has a corrupt manifest.json (no step)")
        return step

    @property
    def layout(self) -> dict[str, int]:
        """The layout that saved it (`{"tp": .., "pp": .., "dp": ..}`, `ParallelDims.layout`)."""
        return dict(self._manifest["layout"])

    @property
    def good(self) -> bool:
        """False when it was saved as bad (during a bad-step streak or after a spike)."""
        return self._manifest.get("good", True) is not False

    @property
    def config(self) -> dict[str, Any]:
        """The saved run's config as `config_to_dict` wrote it (a copy, free to change); empty
        when the checkpoint stored none."""
        return copy.deepcopy(self._manifest["trainer"].get("config", {}))

    @property
    def tokenizer(self) -> Tokenizer | HFTokenizer:
        """The tokenizer saved with it (sentencepiece model or tokenizer.json), verified."""
        saved = [n for n in (HFTokenizer.file_name, Tokenizer.file_name) if n in self._files]
        if not saved:
            raise CheckpointError(f"checkpoint {self.path} carries no tokenizer")
        self.verify_tokenizer()
        return open_tokenizer(self.path / saved[0])

    def verify_tokenizer(self) -> None:
        """Check the tokenizer files it lists, whole (they are small)."""
        names = [name for name in self._files if name.startswith("tokenizer")]
        verify_files_of(self.path, self._manifest, names)

    def check_present(self) -> None:
        """Every file the manifest lists is in the directory (one listing, not one look-up per
        file); refused naming the missing ones."""
        missing = sorted(set(self._files) - {p.name for p in self.path.iterdir()})
        if missing:
            raise corrupt(self.path, f"{', '.join(missing)} is missing")

    def model(self, device: str = "cpu") -> CausalLM:
        """The whole model as one chunk (tp = pp = 1) with these weights, in eval mode: what
        generation and Hugging Face export run, whatever layout trained it."""
        raw = self.config
        raw["parallel"] = {}  # one process: no tp/pp/sp
        raw["train"]["recompute"] = "none"
        cfg = build_config(raw)
        ps = ParallelState.single(device)
        # The checkpoint fills every weight: no random init to throw away.
        (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps), random_init=False)
        self.load_parameters(dict(model.named_parameters()), ps)
        self.load_routing(routing_tensors([model]))
        return model.eval()

    @torch.no_grad()
    def load_routing(self, routing: dict[str, torch.Tensor]) -> None:
        """Fill the MoE routers' balancing biases (`RunState.routing`) with their saved values
        (checkpoints from before the biases have none: they stay as they are)."""
        for name, tensor in routing.items():
            if name in self._manifest["tensors"]:
                tensor.copy_(self.tensor(name))

    @torch.no_grad()
    def load_parameters(self, params: dict[str, nn.Parameter], ps: ParallelState) -> None:
        """Fill local parameters (global name -> this rank's piece in layout `ps`) with their
        saved values, whatever layout saved them."""
        for name, tensor in global_tensors(params).items():  # a fused parameter by parts
            tensor.copy_(self._tensors.local(tensor.meta.tied_name or name, tensor, ps))

    def weight_names(self) -> list[str]:
        """Global names of the saved model weights (a tied copy is saved once, as its original)."""
        return [name for name in self._manifest["tensors"] if not name.endswith(STATE_KINDS)]

    def tensor(self, name: str) -> torch.Tensor:
        """The full global tensor `name`, without vocabulary padding rows."""
        return self._tensors.tensor(name)


def check_same_model(ckpt: Checkpoint, config: dict[str, Any]) -> None:
    """Refuse to resume `config` (a run's config as `config_to_dict` writes it) from a checkpoint
    of another model, naming every MODEL_IDENTITY field that differs (a field the checkpoint's
    config lacks is not compared)."""
    saved, now = ckpt.config.get("model", {}), config["model"]
    changed = [
        f"model.{key} {json.dumps(saved[key])} -> {json.dumps(now[key])}"
        for key in MODEL_IDENTITY
        if key in saved and saved[key] != now[key]
    ]
    if changed:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds another model than this run's config: "
            f"{', '.join(changed)}. Resume with the checkpoint's model settings, or train the "
            "new model in another train.out_dir"
        )


def sum_over_world(values: list[int], ps: ParallelState) -> list[int]:
    """Collective over the world: `values` (as long on every rank) summed over the ranks."""
    total = torch.tensor(values, dtype=torch.int64, device=ps.device)
    comm.all_reduce(total, ps.world_group)
    return total.tolist()


@torch.no_grad()
def load_checkpoint(
    path: Path, state: RunState, announce: Callable[[Checkpoint], None] | None = None
) -> Checkpoint:
    """Collective: restore `state` from the checkpoint at `path`: weights and optimizer state
    (from any layout), the RNG streams (saved in this layout only), then step, data position
    and loss scaler. `announce` runs in between, so that a resume whose data order is refused
    has already said what changed. Each rank reads and verifies only what it loads (rank 0 also
    checks that every listed file is there, and the tokenizer); a missing or damaged file stops
    every rank, before any trains from the checkpoint (one flag vector, summed)."""
    ckpt = Checkpoint(path, verify_files=False)
    check_same_model(ckpt, state.config)
    ps, failure = state.ps, None
    try:
        _load_tensors(ckpt, state)
    except Exception as exc:  # every rank must reach the agreement below, then raise
        failure = exc
    flags = [int(rank == ps.rank and failure is not None) for rank in range(ps.world_size)]
    failed = [rank for rank, flag in enumerate(sum_over_world(flags, ps)) if flag]
    ckpt._tensors.close()
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(
            f"checkpoint {ckpt.path} could not be loaded: rank(s) {failed} refused it (their "
            "error names the file); resume from an earlier checkpoint with "
            "checkpoint.resume=<dir>"
        )
    if announce is not None:
        announce(ckpt)
    state.load_trainer_state(ckpt._manifest["trainer"])
    return ckpt


def _load_tensors(ckpt: Checkpoint, state: RunState) -> None:
    """This rank's share of `load_checkpoint`: the weights it holds, the optimizer state of the
    ranges it owns (those ranges alone, cut on the host, then moved to the device) and its RNG
    streams when the layout is the saved one."""
    ps, manifest, tensors = state.ps, ckpt._manifest, ckpt._tensors
    if ps.rank == 0:
        ckpt.check_present()
        ckpt.verify_tokenizer()
    if not state.optimizer.params_sharded:  # ZeRO-3: the owned masters below are the weights
        ckpt.load_parameters(state.params, ps)
    ckpt.load_routing(state.routing)

    def read_state(name: str, tensor: torch.Tensor, kind: str, lo: int, hi: int) -> torch.Tensor:
        source = state_name(tensor.meta.tied_name or name, kind)
        return tensors.local_range(source, tensor, ps, lo, hi).to(ps.device)

    state.optimizer.load_pieces(read_state, manifest["optimizer_step"])
    if manifest["layout"] == ps.dims.layout():
        rng = tensors.file(rng_file(ps.rank))
        state.rng.load_state_dict({key: tensors.read(rng.name, key) for key in rng.header})
