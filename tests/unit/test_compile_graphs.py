"""What `train.compile` cuts a block into. At tp 1 the linears are traced (`traced_linear`), so a
block is one graph with no break; with them opaque (tp > 1, or a split backward) every linear
breaks the graph. Inside a compiled region the elementwise kernels take their traceable
references under `auto` even where Triton would run (a GPU), so that inductor fuses them."""

import pytest
import torch
from megalite.kernels import bias_gelu, dispatch, layer_norm, rms_norm, rotary_embedding, swiglu
from megalite.kernels.gelu import bias_gelu_reference
from megalite.kernels.norms import layer_norm_reference, rms_norm_reference
from megalite.kernels.rotary import rotary_embedding_reference
from megalite.kernels.swiglu import swiglu_reference
from megalite.models.factory import build_chunks

from megalite.config import load_config
from megalite.data_parallel.grad_buffer import build_grad_buffers
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom
from megalite.tensor_parallel.deferred import WeightGradQueue
from megalite.tensor_parallel.linear import (
    _deferred_column_weight_grads,
    _deferred_row_weight_grad,
)
from megalite.training.compile import (
    CompileWatch,
    can_trace_linears,
    compile_blocks,
    compiled_graphs,
)

ARCHS = {
    "gpt": ["model.arch=gpt"],
    "llama": ["model.arch=llama", "model.n_kv_heads=2"],
    "mixtral": [
        "model.arch=mixtral",
        "model.moe_experts=4",
        "model.moe_top_k=2",
        "model.n_kv_heads=2",
    ],
}


def _compiled_model(
    arch: str, trace_linears: bool, overrides: tuple[str, ...] = ()
) -> torch.nn.Module:
    """A 3-block model, its blocks compiled, in a fresh dynamo."""
    import torch._dynamo as dynamo  # here: importing it imports Triton (see compile.py)

    dynamo.reset()
    sizes = ["model.n_layers=3", "model.hidden=64", "model.n_heads=4", "model.vocab_size=300"]
    cfg = load_config(None, [*ARCHS[arch], *sizes, "model.seq_len=24", *overrides])
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(3, ps))
    compile_blocks([model], trace_linears)
    return model


def _loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(seed))
    return model(tokens[:, :-1], tokens[:, 1:]).sum()


def _graphs_and_breaks(arch: str, trace_linears: bool) -> tuple[int, int]:
    """(graphs compiled, graph breaks) by one forward and backward of a 3-block model."""
    import torch._dynamo.utils as dynamo_utils

    model = _compiled_model(arch, trace_linears)
    graph_breaks = dynamo_utils.counters["graph_break"]
    graphs, breaks = compiled_graphs(), sum(graph_breaks.values())
    _loss(model).backward()
    return compiled_graphs() - graphs, sum(graph_breaks.values()) - breaks


def test_traced_linears_make_each_block_one_graph():
    """GPT's blocks (a Llama's one graph: tests/kernels/test_model_kernels.py)."""
    assert _graphs_and_breaks("gpt", trace_linears=True) == (1, 0)  # one graph serves 3 blocks
    graphs, breaks = _graphs_and_breaks("gpt", trace_linears=False)
    assert graphs > 1 and breaks > 0  # the opaque linears cut it


@pytest.mark.parametrize(
    "overrides", [(), ("model.moe_capacity_factor=1.0",)], ids=["dropless", "capacity"]
)
def test_moe_blocks_compile_nothing_for_another_routing(overrides):
    """The rows per expert (with drops, the rows kept too) differ with every micro-batch: the
    experts run eager between the compiled pieces, so a batch routed otherwise compiles no new
    graph (static shapes would recompile for each, until dynamo's recompile limit)."""
    model = _compiled_model("mixtral", True, overrides)
    _loss(model).backward()
    graphs = compiled_graphs()
    for seed in range(1, 4):
        _loss(model, seed).backward()
    assert compiled_graphs() == graphs


def test_linears_are_traced_only_at_tp1_with_an_unsplit_backward():
    assert can_trace_linears(1, "1f1b") and can_trace_linears(1, "interleaved")
    assert not can_trace_linears(2, "1f1b")
    assert not can_trace_linears(1, "zb-h1") and not can_trace_linears(1, "zb-v")


@pytest.mark.parametrize("trace_linears", [False, True])
def test_only_opaque_linears_defer_their_weight_gradients(trace_linears):
    """Why a split backward keeps the linears opaque: a B step of traced ones computes their
    weight GEMMs itself, leaving the W step nothing to fill the bubbles with."""
    model = _compiled_model("gpt", trace_linears)
    (buffer,) = build_grad_buffers([model], ParallelState.single(), bucket_mb=1.0, zero=0)
    loss, queue = _loss(model), WeightGradQueue()
    with model.ctx.deferral.deferring(queue):
        loss.backward()
    deferred = [getattr(work, "func", None) for work in queue.work]
    gemms = [f for f in deferred if f in (_deferred_column_weight_grads, _deferred_row_weight_grad)]
    assert len(gemms) == (0 if trace_linears else 4 * 3)  # qkv, out, fc, proj; 3 blocks
    queue.run()  # every gradient arrives either way
    assert buffer.arrived == set(model.parameters())


def _fusable_calls():
    """(kernel call, reference call) pairs on fresh inputs."""
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 7, 48, generator=g), torch.randn(2, 7, 48, generator=g)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    q, k = torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)
    cos, sin = torch.randn(9, 16, generator=g), torch.randn(9, 16, generator=g)
    return [
        (lambda: layer_norm(x, w, b, 1e-5, r), lambda: layer_norm_reference(x, w, b, 1e-5, r)),
        (lambda: rms_norm(x, w, 1e-5, r), lambda: rms_norm_reference(x, w, 1e-5, r)),
        (lambda: bias_gelu(x, b), lambda: bias_gelu_reference(x, b)),
        (lambda: swiglu(x, r), lambda: swiglu_reference(x, r)),
        (
            lambda: rotary_embedding(q, k, cos, sin),
            lambda: rotary_embedding_reference(q, k, cos, sin),
        ),
    ]


@pytest.mark.parametrize(
    "index", range(5), ids=["layer_norm", "rms_norm", "bias_gelu", "swiglu", "rotary"]
)
def test_compiled_region_fuses_the_elementwise_kernels_under_auto(index, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")
    monkeypatch.setattr(dispatch, "kernel_backend", lambda *tensors: "triton")  # as on a GPU
    call, reference = _fusable_calls()[index]
    assert dispatch.use_triton(torch.zeros(1), fusable=True)  # eager: the Triton kernel
    import torch._dynamo as dynamo

    dynamo.reset()
    # fullgraph: a Triton launch (an opaque op) would be a graph break, and an error here
    compiled = torch.compile(call, fullgraph=True, dynamic=False)()
    for got, want in zip(
        torch.utils._pytree.tree_leaves(compiled), torch.utils._pytree.tree_leaves(reference())
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_frame_stopped_at_the_recompile_limit_in_the_first_step_counts():
    """Shapes that change within the first step, past dynamo's recompile limit: the frame runs
    eager from then on and compiles no graph after the first step, yet it is a recompile.
    (dynamo's own `config.patch`: pytest's monkeypatch undoes a module attribute it did not
    find in the module's __dict__ by deleting it, which hides the setting from every later
    compile in the process.)"""
    import torch._dynamo as dynamo

    dynamo.reset()
    with dynamo.config.patch(recompile_limit=2):
        scale = torch.compile(lambda x: x * 2 + 1, dynamic=False, backend="eager")
        watch = CompileWatch()
        for rows in range(1, 5):  # one micro-batch shape each: 2 graphs, then the limit
            scale(torch.ones(rows))
        watch.step_done()
        scale(torch.ones(1))
    assert watch.recompiles == 1
