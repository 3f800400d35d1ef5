# TEMPORARY (not committed): reference block attention until the kernel branch lands.
import math

import torch


def _mask(sq, sk, q_offset, k_offset, causal, doc_start, device):
    qp = q_offset + torch.arange(sq, device=device)
    kp = k_offset + torch.arange(sk, device=device)
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        m = kp[None, :] <= qp[:, None]
    m = m[None, None]
    if doc_start is not None:
        m = m & (kp[None, None, None, :] >= doc_start[:, None, :, None].long())
    return m


def _scores(q, k, scale):
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale


def attention_block_forward(
    q, k, v, *, q_offset=0, k_offset=0, causal=True, doc_start=None, softmax_scale=None
):
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    s = _scores(q, k, scale).masked_fill(
        ~_mask(q.shape[1], k.shape[1], q_offset, k_offset, causal, doc_start, q.device), -math.inf
    )
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    group = q.shape[2] // k.shape[2]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float().repeat_interleave(group, dim=2))
    return out.to(q.dtype), lse


def attention_block_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    q_offset=0,
    k_offset=0,
    causal=True,
    doc_start=None,
    softmax_scale=None,
    delta=None,
):
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    s = _scores(q, k, scale).masked_fill(
        ~_mask(q.shape[1], k.shape[1], q_offset, k_offset, causal, doc_start, q.device), -math.inf
    )
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if delta is None:
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    vr = v.float().repeat_interleave(group, dim=2)
    kr = k.float().repeat_interleave(group, dim=2)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout.float())
    dp = torch.einsum("bqhd,bkhd->bhqk", dout.float(), vr)
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float())
    b, sk, hkv, d = k.shape
    dk = dk.view(b, sk, hkv, group, d).sum(3)
    dv = dv.view(b, sk, hkv, group, d).sum(3)
    return dq, dk, dv
