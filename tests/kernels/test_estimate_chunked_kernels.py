"""The estimator's GPU figure for a block over a chunk layout (document masks: the block attention
of `context_parallel.attention`, rotary at the documents' positions), with the Triton kernels
(run by the interpreter on CPU): what the block saves, to the byte."""

import pytest
import torch
from megalite.models.factory import build_chunks

from megalite.config import load_config
from megalite.context_parallel.layout import SequenceLayout
from megalite.parallel_state import ParallelState
from megalite.profiling.activations import Shapes, layer_body
from megalite.profiling.memory import SavedActivationTracker
from megalite.tensor_parallel import TPRandom

MODELS = {"gpt": ["model.arch=gpt"], "llama": ["model.arch=llama", "model.n_kv_heads=2"]}
EOS = 0


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_on_gpu_counts_what_a_block_saves_over_documents(arch, precision):
    """A block under `data.document_mask` saves its input and `layer_body` of the estimate's
    GPU shapes: the flash kernel's tensors (the block attention keeps the same q, k, v, output
    and log-sum-exp) and, for Llama, the cos and sin rows the Triton rotary gathers at the
    documents' positions."""
    sizes = ["model.n_layers=1", "model.hidden=64", "model.n_heads=4", "model.vocab_size=300"]
    sizes += ["model.seq_len=40", "train.micro_batch_size=2", f"train.precision={precision}"]
    cfg = load_config(None, [*MODELS[arch], *sizes, "data.document_mask=true"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(3, ps))
    model.to(dtype)
    tokens = torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(5))
    tokens[0, 13] = tokens[1, 29] = EOS  # two documents in each window
    layout = SequenceLayout.build(40, 1, 0, torch.device("cpu"), tokens, EOS)
    assert not layout.plain
    x = torch.randn(2, 40, 64, dtype=dtype, requires_grad=True)
    with SavedActivationTracker(exclude=[*model.parameters(), *model.buffers()]) as saved:
        out = model.layers["0"](x, layout)
    shapes = Shapes(cfg, element=x.element_size(), device="cuda")
    assert out.requires_grad  # its graph holds what the block saved
    assert saved.current == x.numel() * x.element_size() + sum(layer_body(shapes))
