"""The equivalence principle at the sizes users run: the shipped tiny configs as they are
(vocab 8000, seq 256, width 256, micro-batch 8), not the toy shapes of the other tests.

At toy sizes every rank's share of the vocabulary fits in one head chunk, so rank-local chunking
never shows; here the head runs several chunks and a ragged last one, padded vocabulary rows sit
on the last tp rank, and the 3D layout of the README runs on 8 ranks. Each case trains 2 steps
and compares per-step loss and gradient norm with the single process of the same config
(1e-5 relative); the collective trace of `megalite.launch.run_ranks` checks every collective.

Grid (world size, what it covers), and one resume across layouts at these sizes:
    2  gpt   tp 2            the README's first command; 2 head chunks per micro-batch
    2  gpt   tp 2 sp, mb 5   a ragged last head chunk (1280 tokens in chunks of 1024)
    2  gpt   tp 2 sp compiled  train.compile: every block compiled, the tp linears eager
    2  llama zero 1 compiled  train.compile at tp 1 (dp 2): linears traced, a block one graph
    4  llama tp 4 sp, mb 16  GQA with kv heads < tp; a rank of mostly padded vocabulary
    4  llama tp 2 zero 1     dp 2 with ZeRO-1 buckets of real-size parameters
    2  gpt   pp 2 gpipe      tied embeddings across stages, 4 micro-batches
    2  llama pp 2 1f1b       4 micro-batches
    2  gpt   pp 2 vpp 2      interleaved, 4 chunks of one layer, 4 micro-batches
    2  llama pp 2 zb-h1      the split backward (W steps), 4 micro-batches
    2  gpt   pp 2 zb-v       the V: rank 0 holds the first and last chunk (tied embeddings)
    2  llama zero 2 dp 2, offload, segments recompute, 1 MB buckets (a bucket per tensor or less)
    4  gpt   pp 2 zero 2 (dp 2), 1 MB buckets: the tied embedding's own bucket over both stages
    4  gpt   cp 2 tp 2 sp    chunks of 64 tokens, each split over tp: 32-token SP shards
    4  llama cp 2 pp 2, document masks: the data path of masking (the last stage reads the
                             tokens too, both stages carry the layout; few windows hold a book's
                             end, so the boundaries themselves are test_document_mask's)
    8  mixtral ep 2 cp 2 tp 2 sp, capacity 1.0: the drops decided over the whole windows from
                             32-token SP shards of 64-token cp chunks, 8 experts
    8  gpt   tp 2 sp pp 2 zero 1 (dp 2)   the README's 8-rank example
"""

import pytest
from equivalence import assert_same_losses, reference, run_layout

GPT, LLAMA = "configs/gpt-tiny.yaml", "configs/llama-tiny.yaml"
MIXTRAL = "configs/mixtral-tiny.yaml"
SHORT = (
    "train.steps=2",
    "train.log_interval=1",
    "train.eval_interval=1000",
    "train.device=cpu",
    "train.precision=fp32",
    "checkpoint.interval=0",
    "logging.progress=false",
)


def _batch(micro: int, global_: int) -> tuple[str, ...]:
    return (f"train.micro_batch_size={micro}", f"train.global_batch_size={global_}")


CASES = {
    "gpt-tp2": (2, GPT, (), ("parallel.tp=2",)),
    "gpt-tp2-sp-ragged-chunk": (2, GPT, _batch(5, 10), ("parallel.tp=2", "parallel.sp=true")),
    "gpt-tp2-sp-compiled": (
        2,
        GPT,
        (),
        ("parallel.tp=2", "parallel.sp=true", "train.compile=true"),
    ),
    "llama-dp2-zero1-compiled": (
        2,
        LLAMA,
        _batch(8, 16),
        ("parallel.zero=1", "train.compile=true"),
    ),
    "llama-tp4-sp-mb16": (4, LLAMA, _batch(16, 16), ("parallel.tp=4", "parallel.sp=true")),
    "llama-tp2-zero1": (4, LLAMA, _batch(8, 16), ("parallel.tp=2", "parallel.zero=1")),
    "gpt-pp2-gpipe": (2, GPT, _batch(4, 16), ("parallel.pp=2", "parallel.schedule=gpipe")),
    "llama-pp2-1f1b": (2, LLAMA, _batch(4, 16), ("parallel.pp=2", "parallel.schedule=1f1b")),
    "gpt-pp2-vpp2-interleaved": (
        2,
        GPT,
        _batch(2, 8),
        ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"),
    ),
    "llama-pp2-zb-h1": (2, LLAMA, _batch(4, 16), ("parallel.pp=2", "parallel.schedule=zb-h1")),
    "gpt-pp2-zb-v": (
        2,
        GPT,
        _batch(2, 8),
        ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-v"),
    ),
    "llama-zero2-offload-segments": (
        2,
        LLAMA,
        _batch(4, 16),
        (
            "parallel.zero=2",
            "parallel.bucket_mb=1",
            "optim.offload=cpu",
            "train.recompute=segments",
        ),
    ),
    "gpt-pp2-zero2": (
        4,
        GPT,
        _batch(4, 16),
        ("parallel.pp=2", "parallel.zero=2", "parallel.bucket_mb=1"),
    ),
    "gpt-cp2-tp2-sp": (
        4,
        GPT,
        _batch(8, 16),
        ("parallel.cp=2", "parallel.tp=2", "parallel.sp=true"),
    ),
    "llama-docmask-cp2-pp2": (
        4,
        LLAMA,
        _batch(4, 16) + ("data.document_mask=true",),
        ("parallel.cp=2", "parallel.pp=2"),
    ),
    "mixtral-ep2-tp2-sp": (
        4,
        MIXTRAL,
        _batch(8, 16),
        ("parallel.ep=2", "parallel.tp=2", "parallel.sp=true"),
    ),
    "mixtral-capped-ep2-cp2-tp2-sp": (
        8,
        MIXTRAL,
        _batch(8, 16) + ("model.moe_capacity_factor=1.0",),
        ("parallel.ep=2", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true"),
    ),
    "gpt-3d-readme": (
        8,
        GPT,
        _batch(8, 32),
        ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=1"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shipped_config_layout_matches_single_process(builtin_corpus_8000, tmp_path, case):
    world_size, config, batch, layout = CASES[case]
    ref_losses, _ = reference(SHORT + batch, config)
    losses, _ = run_layout(world_size, SHORT + batch + layout, tmp_path, config)
    assert len(losses) == 2
    assert_same_losses(losses, ref_losses)


def test_shipped_config_resumes_in_another_layout(builtin_corpus_8000, tmp_path):
    """llama-tiny saved after step 1 by dp 2 with ZeRO-1 in 1 MB buckets (many buckets; each cut
    in half between the dp ranks, so the embedding's and other tensors' Adam state is stored as
    two segments from two files), resumed for step 2 by tp 2 with its padded vocabulary: the
    single process's losses."""
    batch = _batch(8, 16)
    save = ("parallel.zero=1", "parallel.bucket_mb=1", "checkpoint.interval=1", "train.steps=1")
    run_layout(2, SHORT + batch + save, tmp_path, LLAMA)
    (tmp_path / "metrics.jsonl").write_text("")
    resumed, _ = run_layout(2, SHORT + batch + ("parallel.tp=2",), tmp_path, LLAMA)
    ref_losses, _ = reference(SHORT + batch, LLAMA)
    assert len(resumed) == 1
    assert_same_losses(resumed, ref_losses[1:])
