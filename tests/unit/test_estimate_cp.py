"""The memory estimate under context parallelism: every activation term is that of seq_len / cp
tokens, parameters and gradients are replicated over cp while ZeRO shards over dp x cp (as a
built model's gradient buffers cut them), the ring's transients are a line of their own, the
layout line shows cp, document masks change only what the code keeps; and the README's
long-sequence figures are what `megalite estimate` prints."""

import re
import shlex
from collections import Counter
from pathlib import Path

import pytest
import torch
from megalite.models.factory import build_chunks
from megalite.models.formulas import Shapes, rotary_saved

from megalite.cli import main
from megalite.config import load_config
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState
from megalite.profiling.activations import attention_working_sets, layer_body
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.parameters import buckets_of, chunk_parameters
from megalite.tensor_parallel import TPRandom

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.n_layers=4", "model.hidden=64", "model.n_heads=4", "model.vocab_size=500"]
LONG = ["model.seq_len=4096", "train.micro_batch_size=2"]
ARCHES = {"gpt": ["model.arch=gpt"], "llama": ["model.arch=llama", "model.n_kv_heads=2"]}


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_activation_term_is_that_of_seq_over_cp_tokens(arch, device, sp, cp):
    """Term by term, a layer at cp keeps what it keeps at cp 1 divided by cp; Llama's rotary
    adds the cos / sin rows gathered at the chunks' positions (2 x tokens x head_dim), which
    positions 0..s-1 read from the tables themselves. No term is quadratic in the sequence."""
    layout = ["parallel.tp=2", f"parallel.sp={str(sp).lower()}", "train.precision=bf16"]
    one = load_config(None, [*TINY, *ARCHES[arch], *LONG, *layout])
    cut = load_config(None, [*TINY, *ARCHES[arch], *LONG, *layout, f"parallel.cp={cp}"])
    whole, local = Shapes(one, 2, device), Shapes(cut, 2, device)
    assert local.tokens * cp == whole.tokens and local.seq == 4096 // cp
    rotary = rotary_saved(local)
    if arch == "llama":
        assert rotary == [local.tokens * cut.model.head_dim * 2] * 2
    assert rotary_saved(whole) == [] and (arch == "llama") == (cut.model.arch == "llama")
    kept = Counter(layer_body(local))
    if arch == "llama":
        kept -= Counter(rotary)
    assert kept == Counter(n // cp for n in layer_body(whole))


def test_document_masks_change_only_what_the_code_keeps():
    """At cp 1 a document mask keeps the same attention tensors (the block attention saves
    what the flash kernel does); Llama adds the gathered rotary rows, GPT's positions become a
    row per window (they restart at each document); the block attention's working buffers are
    a transient."""
    for arch, extra in (("gpt", 0), ("llama", 1)):
        plain = load_config(None, [*TINY, *ARCHES[arch], *LONG])
        masked = load_config(None, [*TINY, *ARCHES[arch], *LONG, "data.document_mask=true"])
        x, y = Shapes(plain, 4, "cpu"), Shapes(masked, 4, "cpu")
        added = sum(layer_body(y)) - sum(layer_body(x))
        assert added == extra * 2 * y.tokens * masked.model.head_dim * 4
        assert attention_working_sets(x)[1][1] == 0 < attention_working_sets(y)[1][1]
        est_plain, est_masked = estimate_layout(plain, 1, "cpu"), estimate_layout(masked, 1, "cpu")
        for part in ("parameters", "gradients", "optimizer", "buffers"):
            assert est_plain.stages[0].part(part) == est_masked.stages[0].part(part)


def _meta_chunks(cfg, world: int, **coords):
    dims = cfg.parallel.dims(world)
    ps = ParallelState(dims, dims.rank_of(**coords), torch.device("meta"))
    return build_chunks(cfg, ps, TPRandom(0, ParallelState.single()), random_init=False), ps


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_gradients_and_optimizer_are_sharded_over_dp_x_cp(zero):
    """cp 2 x dp 2 holds what dp 4 holds: the same parameters and full gradients as one rank
    (replicated over cp as over dp), ZeRO's shards over the 4 replicas; the buckets are padded
    and owned as a built model's `GradBuffer` (over `dp_cp`) cuts them."""
    base = [*TINY, "model.arch=llama", "model.n_kv_heads=2", "parallel.bucket_mb=0.01"]
    base += [f"parallel.zero={zero}", "train.precision=bf16", "train.micro_batch_size=1"]
    base += ["train.global_batch_size=8"]
    cp2 = load_config(None, [*base, "parallel.cp=2", "parallel.tp=2"])
    dp4 = load_config(None, [*base, "parallel.tp=2"])
    cp_est, dp_est = estimate_layout(cp2, 8), estimate_layout(dp4, 8)
    assert (cp_est.dp, cp_est.replicas, dp_est.dp, dp_est.replicas) == (2, 4, 4, 4)
    for part in ("parameters", "buffers", "gradients", "gradient staging", "optimizer"):
        assert cp_est.stages[0].part(part) == dp_est.stages[0].part(part), part
    alone = estimate_layout(load_config(None, [*base, "parallel.tp=2", "parallel.zero=0"]), 2)
    assert cp_est.stages[0].part("parameters") == alone.stages[0].part("parameters")
    if zero:
        assert cp_est.stages[0].part("optimizer") < alone.stages[0].part("optimizer") / 3
    [chunk], ps = _meta_chunks(cp2, 8, tp=1, cp=1, dp=1)
    assert (ps.coord("cp"), ps.size("dp", "cp")) == (1, 4)
    predicted = chunk_parameters(cp2, range(4), True, True)
    params = list(reversed(list(chunk.parameters())))
    buffer = GradBuffer(params, ps, 2560, shard_optimizer=zero > 0)
    assert buckets_of(predicted, 2560, 4) == [b.numel for b in buffer.buckets]


def test_ring_buffers_are_a_transient_and_the_layout_line_shows_cp(capsys):
    """llama-7b at 131072 tokens on 64 ranks: with cp the table carries the ring's K/V blocks
    and fp32 accumulators as a line of their own (the all-gather's whole-window K/V are
    larger), the layout line says cp and the tokens a rank holds, the activations fall by
    cp, and the world is tp x cp x dp x pp."""
    seq = ["model.seq_len=131072", "train.recompute=none"]
    base = load_config("configs/llama-7b.yaml", seq)
    ring = load_config("configs/llama-7b.yaml", [*seq, "parallel.cp=4"])
    gather = load_config(
        "configs/llama-7b.yaml", [*seq, "parallel.cp=4", "parallel.cp_comm=allgather"]
    )
    plain, ringed, gathered = (estimate_layout(c, 64) for c in (base, ring, gather))
    assert (plain.dp, ringed.dp) == (4, 1)
    x = Shapes(ring, 2, "cuda")
    rotary = sum(rotary_saved(x)) * 8  # the gathered rows of a chunk's 8 layers
    for before, after in zip(plain.stages, ringed.stages, strict=True):
        assert before.in_flight == after.in_flight
        shrinking = after.part("activations") - after.in_flight * rotary
        assert shrinking * 4 == before.part("activations")
    buffers = ringed.stages[0].part("ring attention buffers")
    kv_block = 2 * 1 * 32768 * 4 * 128 * 2  # (k, v) x b x s/cp x 32/8 kv heads x head_dim, bf16
    assert x.tokens == 32768 and buffers == attention_working_sets(x)[1][1]
    assert buffers == 2 * kv_block + 3 * 2 * kv_block + 32768 * 4 * 128 * 4 + 4 * 32768 * 4
    # gathered twice over (pieces and whole window) with the local block, and the whole
    # window's fp32 dK/dV twice (summed, cut into holders' pieces) with this rank's piece
    gathered_kv = kv_block + 2 * 4 * kv_block + (2 * 4 + 1) * 2 * kv_block
    dq_delta = 32768 * 4 * 128 * 4 + 4 * 32768 * 4
    assert gathered.stages[0].part("all-gathered K/V") == gathered_kv + dq_delta > 3 * buffers
    assert main(["estimate", "--config", "configs/llama-7b.yaml", "--world-size", "64", *seq,
                 "parallel.cp=4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("layout: tp=8 cp=4 (p2p, 32768 tokens per rank) pp=2 vpp=2 dp=1 ")
    assert "ring attention buffers" in out and "ZeRO shards over dp x cp = 4" in out
    assert main(["estimate", "--world-size", "6", "parallel.cp=4"]) == 2
    assert "not divisible by tp*cp*pp = 1*4*1" in capsys.readouterr().err


def _readme_estimates() -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) of each `$ megalite estimate` in the
    README's text blocks."""
    text = (REPO / "README.md").read_text()
    shown = []
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("$ megalite estimate"):
                shown.append((line[2:], []))
            elif shown and line.strip() and line.strip() != "...":
                shown[-1][1].append(line.rstrip())
    return shown


def test_readme_long_sequence_figures_are_what_estimate_prints(capsys, monkeypatch):
    """The README shows llama-7b at 131072 tokens on 64 GPUs without and with cp: each command
    runs, and every line shown under it is a line of its output."""
    shown = _readme_estimates()
    assert len(shown) >= 2 and any("parallel.cp=" in command for command, _ in shown)
    monkeypatch.chdir(REPO)
    for command, lines in shown:
        assert main(shlex.split(command)[1:]) == 0, command
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
        assert lines and all(line in printed for line in lines), (command, lines, printed)
