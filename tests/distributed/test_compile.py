"""`train.compile` (regional torch.compile of every block) computes what eager computes: per-step
losses and gradient norms within fp32 rounding of the single-process eager run, in the single
process, at tp 2 + SP, at pp 2 with virtual stages and full recompute (the same compiled
block then runs on two chunks per rank, at every schedule position, and again in backward), under
zb-h1 (at tp 1, yet with opaque linears: their weight gradients wait for the W steps), under
ZeRO-2 at dp 2, and for a mixture of experts.
Nothing is compiled after step 1: evaluation between steps runs eager. Dropout masks equal
eager's (`fallback_random`)."""

import json

import pytest
from equivalence import assert_equivalent

GPT = ("model.arch=gpt",)
GPT_DROPOUT = ("model.arch=gpt", "model.dropout=0.1")
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
MIXTRAL = ("model.arch=mixtral", "model.moe_experts=4", "model.moe_top_k=2", "model.n_kv_heads=2")
COMPILE = ("train.compile=true",)


@pytest.mark.parametrize(
    ("model", "world_size", "layout"),
    [
        (GPT_DROPOUT, 1, ("train.eval_interval=4",)),
        (LLAMA, 2, ("parallel.tp=2", "parallel.sp=true")),
        (
            GPT,
            2,
            (
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.schedule=interleaved",
                "train.micro_batch_size=1",
                "train.recompute=full",
            ),
        ),
        # tp 1, but the linears defer their weight gradients to W steps: they stay opaque
        # (`can_trace_linears`); traced, the B steps would compute them, still correctly
        (GPT, 2, ("parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batch_size=1")),
        # traced linears' gradients arrive as .grad: into ZeRO-2's staged, sharded buckets
        (GPT, 2, ("parallel.zero=2",)),
        (MIXTRAL, 1, ()),  # the router, experts and their counts inside a traced block
    ],
    ids=[
        "gpt-dropout-single-eval",
        "llama-tp2-sp",
        "gpt-pp2-vpp2-recompute",
        "gpt-pp2-zb-h1",
        "gpt-dp2-zero2",
        "mixtral-single",
    ],
)
def test_compiled_equals_eager(builtin_corpus, tmp_path, model, world_size, layout):
    assert_equivalent(world_size, model, (*layout, *COMPILE), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["compile_s"] > 0.0
    assert [row["recompiles"] for row in rows] == [0] * len(rows)
