"""Benchmark megalite's fused kernels against PyTorch on a GPU, and print a table.

Attention: forward and forward+backward TFLOP/s and peak memory of the Triton flash attention
against ``torch.nn.functional.scaled_dot_product_attention`` (pinned to its flash backend when
it accepts the inputs, else torch's own pick), over sequence lengths at a fixed number of
tokens per step. FLOPs: 4*b*h*s*s*d forward, half of that when causal; backward 2.5x forward.
Peak memory is the most allocated above the inputs during one forward+backward.

Attention blocks (ring attention, packed documents): `attention_block_forward` and
`attention_block_backward` of a query chunk of ``s`` rows against one key chunk of ``s`` keys,
beside the plain kernel doing the same work at the same size: the diagonal chunk (equal
offsets, causal) against causal flash attention, an earlier chunk (every key visible) against
non-causal, and ``flash_attention(cu_seqlens=...)`` over documents of ``--doc-len`` tokens
against plain causal (its FLOPs are those of its documents, 2*h*d*sum(len^2) per window).

MLP activations, norms and rotary: GB/s of the fused bias-GELU, SwiGLU, residual add +
LayerNorm / RMSNorm and rotary q/k against their eager PyTorch references. Both columns count
the bytes a fused kernel must move (read inputs, write outputs), so eager's extra temporaries
show up as lower GB/s.

Weight-gradient accumulation (Megatron's gradient-accumulation fusion): ``main_grad += dy^T x``
into an fp32 main grad from 16-bit dy and x, for the shapes of one block's linears. Contenders:
the Triton kernel (`wgrad_accumulate`); what runs without fusion, a 16-bit GEMM whose result is
added into the main grad (``main_grad.add_(dy.t() @ x)``); and, where torch has it, cuBLAS's
fp32-output GEMM accumulating in place (``torch.addmm(..., out_dtype=torch.float32)``). TFLOP/s
counts 2*tokens*out*in; GB/s the bytes a fused kernel must move (dy, x, and the main grad read
and written).

LM-head softmax cross-entropy: `softmax_cross_entropy` over one chunk of the head's logits
(the head's own chunk length for the vocabulary, GPT-2's 50,257 padded to 50,304 by default,
at most --mlp-tokens rows):
the loss and the gradient written over the logits, against the eager fp32 chain it replaces.
GB/s counts what the kernels must move: the 16-bit logits read twice and written once.

    python tools/bench_kernels.py                  # needs CUDA
    python tools/bench_kernels.py --cpu-smoke      # tiny sizes under the Triton interpreter:
                                                   # checks that it runs, the times mean nothing
    python -m megalite.benchmarks.kernels          # the same, from an installed megalite

megalite.kernels is imported only inside the functions: `--cpu-smoke` sets TRITON_INTERPRET
before the first import of triton.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch  # does not import triton, so TRITON_INTERPRET can still be set below
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; `--cpu-smoke` replaces the sizes by tiny ones."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seq)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (no GQA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-seqlens", type=int, nargs="+", default=[32768],
                   help="chunk lengths of the attention-block (ring) table")  # fmt: skip
    p.add_argument("--doc-len", type=int, default=2048, help="document length of its varlen row")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--mlp-tokens", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=16384, help="MLP hidden size for GELU / SwiGLU")
    p.add_argument("--hidden", type=int, default=4096, help="model width for the norms")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary of the head's table")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, Triton interpreter")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.seqlens, args.tokens, args.heads, args.head_dim = [48], 96, 2, 32
        args.block_seqlens, args.doc_len = [48], 20
        args.mlp_tokens, args.ffn, args.hidden, args.vocab = 40, 200, 100, 300
    args.kv_heads = args.kv_heads or args.heads
    return args


def measure(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """(milliseconds per call, peak MiB above what was allocated before); NaNs on OOM."""
    try:
        if device.type != "cuda":  # the interpreter cannot run triton.testing.do_bench
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3, float("nan")
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=25, rep=100)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return ms, (torch.cuda.max_memory_allocated() - base) / 2**20
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan"), float("nan")


def sdpa_baseline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA on our (batch, seq, heads, head_dim) layout; returns (callable, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}

    def attend(backends):
        with sdpa_kernel(backends):
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, **gqa)
            return out.transpose(1, 2)

    try:
        with torch.no_grad():
            attend([SDPBackend.FLASH_ATTENTION])
        return lambda: attend([SDPBackend.FLASH_ATTENTION]), "flash"
    except RuntimeError:  # flash backend refuses (dtype, GQA, device): let torch pick
        return lambda: attend(list(SDPBackend)), "auto"


def attention_row(args: argparse.Namespace, seq: int, device: torch.device) -> str:
    """One table row: TFLOP/s and peak memory of both attentions at sequence length `seq`."""
    from megalite.kernels import flash_attention

    batch = max(1, args.tokens // seq)
    dtype = DTYPES[args.dtype]

    def rand(heads):
        shape = (batch, seq, heads, args.head_dim)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads)
    dout = torch.randn_like(q)
    sdpa, backend = sdpa_baseline(q, k, v, args.causal)
    fwd_flops = 4 * batch * args.heads * seq * seq * args.head_dim * (0.5 if args.causal else 1)
    cells = []
    for fwd in (lambda: flash_attention(q, k, v, causal=args.causal), sdpa):
        with torch.no_grad():
            fwd_ms, _ = measure(fwd, device)
        both_ms, peak = measure(lambda f=fwd: torch.autograd.grad(f(), (q, k, v), dout), device)
        cells.append((fwd_flops / fwd_ms / 1e9, 3.5 * fwd_flops / both_ms / 1e9, peak))
    (tf, tb, tp), (sf, sb, sp) = cells
    return (
        f"{seq:<6} {batch:>5} | {tf:18.1f} {sf:5.1f} | {tb:22.1f} {sb:5.1f}"
        f" | {tp:15.0f} {sp:7.0f} | {backend}"
    )


def attention_block_rows(args: argparse.Namespace, seq: int, device: torch.device) -> list[str]:
    """Rows of the attention-block table at chunk length `seq` (see the module docstring)."""
    from megalite.kernels import attention_block_backward, attention_block_forward, flash_attention

    batch = max(1, args.tokens // seq)
    dtype = DTYPES[args.dtype]

    def rand(heads):
        shape = (batch, seq, heads, args.head_dim)
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    q, k, v = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads)
    dout = torch.randn_like(q)

    def block(q_offset: int, k_offset: int):  # the query chunk at q_offset, keys at k_offset
        offsets = {"q_offset": q_offset, "k_offset": k_offset}

        def both():
            out, lse = attention_block_forward(q, k, v, **offsets)
            return attention_block_backward(dout, q, k, v, out, lse, **offsets)

        return lambda: attention_block_forward(q, k, v, **offsets), both

    def plain(**kwargs):
        def fwd():
            return flash_attention(q, k, v, **kwargs)

        return fwd, lambda: torch.autograd.grad(fwd(), (q, k, v), dout)

    starts = list(range(0, seq, args.doc_len))
    windows = [w * seq + start for w in range(batch) for start in starts]
    cu_seqlens = torch.tensor([*windows, batch * seq], dtype=torch.int32, device=device)
    doc_lens = [min(args.doc_len, seq - start) for start in starts]
    full = 4 * batch * args.heads * args.head_dim * seq * seq  # forward FLOPs, every key seen
    doc_flops = full * sum(n * n for n in doc_lens) / (2 * seq * seq)  # causal in each document
    cases = [  # name, (block fwd, fwd+bwd), forward FLOPs, (plain fwd, fwd+bwd), forward FLOPs
        ("diagonal", block(seq, seq), full / 2, plain(causal=True), full / 2),
        ("earlier", block(seq, 0), full, plain(causal=False), full),
        (f"docs {args.doc_len}", plain(cu_seqlens=cu_seqlens), doc_flops, plain(), full / 2),
    ]
    rows = []
    for name, *contenders in cases:
        cells = []
        for (fwd, both), flops in zip(contenders[::2], contenders[1::2]):
            with torch.no_grad():
                fwd_ms, _ = measure(fwd, device)
            both_ms, _ = measure(both, device)
            cells.append((flops / fwd_ms / 1e9, 3.5 * flops / both_ms / 1e9, both_ms))
        (bf, bb, bms), (pf, pb, pms) = cells
        rows.append(
            f"{seq:<6} {batch:>5} {name:<10} | {bf:17.1f} {pf:6.1f} | {bb:21.1f} {pb:6.1f}"
            f" | {bms:14.2f} {pms:6.2f}"
        )
    return rows


def activation_row(
    name: str,
    fused: Callable[..., Any],
    eager: Callable[..., Any],
    inputs: tuple[torch.Tensor, ...],
    douts: tuple[torch.Tensor, ...],
    fwd_bytes: int,
    both_bytes: int,
    device: torch.device,
) -> str:
    """GB/s for fwd and fwd+bwd of a kernel with one output or several (one dout each);
    *_bytes: what a fused kernel must read and write."""

    def forward_backward(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        outputs = fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return torch.autograd.grad(outputs, inputs, douts)

    rates = []
    for fn in (fused, eager):
        with torch.no_grad():
            fwd_ms, _ = measure(lambda f=fn: f(*inputs), device)
        both_ms, _ = measure(lambda f=fn: forward_backward(f), device)
        rates += [fwd_bytes / fwd_ms / 1e6, both_bytes / both_ms / 1e6]
    fused_fwd, fused_both, eager_fwd, eager_both = rates
    return f"{name:<11} | {fused_fwd:14.0f} {eager_fwd:6.0f} | {fused_both:18.0f} {eager_both:6.0f}"


ROW_HEADER = "kernel      | fwd GB/s fused  eager | fwd+bwd GB/s fused  eager"


def bench_attention(args: argparse.Namespace, device: torch.device) -> None:
    """Print the attention table, one row per sequence length."""
    print(
        f"\nattention: {args.dtype}, causal={args.causal}, heads {args.heads}/{args.kv_heads} "
        f"(q/kv), head_dim {args.head_dim}, {args.tokens} tokens per step"
    )
    header = "seq    batch | fwd TFLOP/s triton  sdpa | fwd+bwd TFLOP/s triton  sdpa"
    print(header + " | peak MiB triton    sdpa | sdpa backend")
    for seq in args.seqlens:
        print(attention_row(args, seq, device))


def bench_attention_blocks(args: argparse.Namespace, device: torch.device) -> None:
    """Print the attention-block table: ring-attention chunks and packed documents against the
    plain kernel, one group of rows per chunk length."""
    print(
        f"\nattention blocks (ring attention, packed documents): {args.dtype}, heads "
        f"{args.heads}/{args.kv_heads} (q/kv), head_dim {args.head_dim}; a chunk of seq queries "
        "against seq keys"
    )
    print(
        "seq    batch block      | fwd TFLOP/s block  plain | fwd+bwd TFLOP/s block  plain"
        " | fwd+bwd ms block  plain"
    )
    for seq in args.block_seqlens:
        for row in attention_block_rows(args, seq, device):
            print(row)


def _rand(device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)


def bench_activations(args: argparse.Namespace, device: torch.device) -> None:
    """Print the MLP activation table: bias-GELU and SwiGLU, fused against eager."""
    from megalite.kernels.gelu import bias_gelu, bias_gelu_reference
    from megalite.kernels.swiglu import swiglu, swiglu_reference

    dtype = DTYPES[args.dtype]
    shape = (args.mlp_tokens, args.ffn)
    print(f"\nMLP activations: {args.dtype}, (tokens, ffn) = {shape}; GB/s of the bytes a fused")
    print("kernel must move (fwd: inputs + output; bwd: dy + inputs + input grads)")
    print(ROW_HEADER)
    dout = (torch.randn(shape, device=device, dtype=dtype),)
    size = dout[0].numel() * dout[0].element_size()
    gelu_inputs = (_rand(device, dtype, *shape), _rand(device, dtype, shape[-1]))
    swiglu_inputs = (_rand(device, dtype, *shape), _rand(device, dtype, *shape))
    # bias-GELU moves x, y (fwd) and dy, x, dx (bwd); SwiGLU gate, up, y and dy, gate, up, 2 grads
    gelu = bias_gelu, bias_gelu_reference, gelu_inputs, dout, 2 * size, 5 * size, device
    print(activation_row("bias-GELU", *gelu))
    swiglu_row = swiglu, swiglu_reference, swiglu_inputs, dout, 3 * size, 8 * size, device
    print(activation_row("SwiGLU", *swiglu_row))


def bench_norms_and_rotary(args: argparse.Namespace, device: torch.device) -> None:
    """Print the table of the residual add + LayerNorm / RMSNorm and of rotary q and k, fused
    against eager (the references, rotary on the strided q/k views attention passes)."""
    from megalite.kernels.norms import (
        layer_norm,
        layer_norm_reference,
        rms_norm,
        rms_norm_reference,
    )
    from megalite.kernels.rotary import rotary_embedding, rotary_embedding_reference
    from megalite.models.layers import rotary_tables

    dtype, tokens, hidden = DTYPES[args.dtype], args.mlp_tokens, args.hidden
    print(f"\nresidual add + norm: {args.dtype}, (tokens, hidden) = ({tokens}, {hidden}); rotary:")
    print(f"{tokens} tokens, heads {args.heads}/{args.kv_heads} (q/kv), head_dim {args.head_dim}")
    print("GB/s of the bytes a fused kernel must move")
    print(ROW_HEADER)
    stream = (_rand(device, dtype, tokens, hidden), _rand(device, dtype, tokens, hidden))
    weight, bias = _rand(device, dtype, hidden), _rand(device, dtype, hidden)
    douts = (torch.randn(tokens, hidden, device=device, dtype=dtype),) * 2  # for h and y
    size = douts[0].numel() * douts[0].element_size()
    # fwd: x, residual in, h, y out; bwd: dh, dy, h in, dx out (the residual's grad is dx)

    def ln(fn):
        return lambda x, r, w, b: fn(x, w, b, 1e-5, residual=r)

    def rms(fn):
        return lambda x, r, w: fn(x, w, 1e-5, residual=r)

    norm = (4 * size, 8 * size, device)
    ln_row = ln(layer_norm), ln(layer_norm_reference), (*stream, weight, bias), douts, *norm
    print(activation_row("LayerNorm", *ln_row))
    rms_row = rms(rms_norm), rms(rms_norm_reference), (*stream, weight), douts, *norm
    print(activation_row("RMSNorm", *rms_row))

    heads, kv_heads, hd = args.heads, args.kv_heads, args.head_dim
    cos, sin = (t.to(device) for t in rotary_tables(hd, tokens, 10000.0))
    qkv = _rand(device, dtype, 1, tokens, (heads + 2 * kv_heads) * hd)

    def rotate(fn):  # q and k: views of the fused q/k/v output, as Attention.forward has them
        def run(qkv):
            q = qkv[..., : heads * hd].view(1, tokens, heads, hd)
            k = qkv[..., heads * hd : (heads + kv_heads) * hd].view(1, tokens, kv_heads, hd)
            return fn(q, k, cos, sin)

        return run

    douts = tuple(
        torch.randn(1, tokens, n, hd, device=device, dtype=dtype) for n in (heads, kv_heads)
    )
    size = (heads + kv_heads) * hd * tokens * qkv.element_size()  # q and k
    rotary_row = rotate(rotary_embedding), rotate(rotary_embedding_reference), (qkv,), douts
    print(activation_row("rotary q/k", *rotary_row, 2 * size, 4 * size, device))


def wgrad_contenders(device: torch.device) -> dict[str, Callable[..., Any]]:
    """The ways to compute ``main_grad += dy^T x``, by name (see the module docstring)."""
    from megalite.kernels.wgrad import wgrad_accumulate

    def unfused(main_grad, dy, x):
        main_grad.add_(dy.t() @ x)

    def cublas_fp32_out(main_grad, dy, x):
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)

    contenders = {"triton": wgrad_accumulate, "16-bit mm + add_": unfused}
    if device.type == "cuda":
        try:  # torch >= 2.8 on CUDA: addmm with an fp32 output from 16-bit inputs
            probe = torch.zeros(8, 8, device=device)
            cublas_fp32_out(probe, *(torch.ones(8, 8, device=device, dtype=torch.bfloat16),) * 2)
            contenders["addmm out_dtype fp32"] = cublas_fp32_out
        except (RuntimeError, TypeError):
            pass
    return contenders


def bench_wgrad(args: argparse.Namespace, device: torch.device) -> None:
    """Print the weight-gradient accumulation table: one row per (out, in) linear shape."""
    dtype, tokens, hidden, ffn = DTYPES[args.dtype], args.mlp_tokens, args.hidden, args.ffn
    contenders = wgrad_contenders(device)
    print(f"\nweight-gradient accumulation: main_grad (fp32) += dy^T x, {args.dtype} inputs,")
    print(f"{tokens} tokens; TFLOP/s and GB/s (dy, x, main grad read and written) per contender")
    print(f"{'(out, in)':<14} | " + " | ".join(f"{name:>21}" for name in contenders))
    for out_features, in_features in (
        (3 * hidden, hidden),
        (hidden, hidden),
        (ffn, hidden),
        (hidden, ffn),
    ):
        dy = torch.randn(tokens, out_features, device=device, dtype=dtype)
        x = torch.randn(tokens, in_features, device=device, dtype=dtype)
        main_grad = torch.zeros(out_features, in_features, device=device)
        flops = 2 * tokens * out_features * in_features
        moved = (dy.numel() + x.numel()) * dy.element_size() + 2 * main_grad.numel() * 4
        cells = []
        for fn in contenders.values():
            ms, _ = measure(lambda f=fn, g=main_grad, a=dy, b=x: f(g, a, b), device)
            cells.append(f"{flops / ms / 1e9:7.1f} TF {moved / ms / 1e6:7.0f} GB/s")
        print(f"{str((out_features, in_features)):<14} | " + " | ".join(cells))


def bench_cross_entropy(args: argparse.Namespace, device: torch.device) -> None:
    """Print the LM-head softmax cross-entropy table: one chunk, fused against eager."""
    from megalite.config import ModelConfig
    from megalite.kernels.cross_entropy import (
        Columns,
        softmax_cross_entropy,
        softmax_cross_entropy_reference,
    )
    from megalite.tensor_parallel.cross_entropy import chunk_tokens
    from megalite.tensor_parallel.layers import padded_vocab_size

    round_to = ModelConfig.vocab_round_to  # as the model pads it
    dtype, cols = DTYPES[args.dtype], padded_vocab_size(args.vocab, 1, round_to)
    rows = min(args.mlp_tokens, chunk_tokens(cols, device))
    logits = _rand(device, dtype, rows, cols)
    target = torch.randint(0, args.vocab, (rows,), device=device)
    moved = 3 * logits.numel() * logits.element_size()

    print(f"\nLM-head softmax cross-entropy: loss and gradient of {rows} tokens x {cols} logits")
    print(f"({args.vocab} real), {args.dtype}; GB/s of the logits read twice and written once")
    print(f"{'contender':<22} | {'ms':>8} | {'GB/s':>8}")
    for name, fn in (("Triton", softmax_cross_entropy), ("eager", softmax_cross_entropy_reference)):
        ms, _ = measure(lambda f=fn: f(logits, target, Columns(args.vocab), True), device)
        print(f"{name:<22} | {ms:8.3f} | {moved / ms / 1e6:8.0f}")


def main(argv: list[str] | None = None) -> int:
    """Run the tables on CUDA (or the interpreter with --cpu-smoke); 1 without a device."""
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before megalite.kernels imports triton
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(
            "bench_kernels: no CUDA device here, and the Triton kernels only run at speed on a "
            "GPU. Run it on a GPU machine, or pass --cpu-smoke for a tiny run under the Triton "
            "interpreter (it checks that everything runs; its timings mean nothing).",
            file=sys.stderr,
        )
        return 1
    from megalite.kernels import dispatch  # after TRITON_INTERPRET is settled

    dispatch.use("triton")  # measure the kernels, never a silent fallback
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}, torch {torch.__version__}")
    bench_attention(args, device)
    bench_attention_blocks(args, device)
    bench_activations(args, device)
    bench_norms_and_rotary(args, device)
    bench_wgrad(args, device)
    bench_cross_entropy(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
