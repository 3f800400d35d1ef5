"""MEGALITE_KERNELS picks the Triton kernels or the PyTorch references, read once per process."""

import os

import pytest
import torch
from megalite.kernels import flash_attention, kernel_backend
from megalite.kernels.flash_attention import FlashAttentionFunction


def test_auto_picks_torch_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")
    assert kernel_backend(torch.zeros(1)) == "torch"
    if not torch.cuda.is_available():
        assert kernel_backend() == "torch"


def test_auto_is_the_default(monkeypatch):
    monkeypatch.delenv("MEGALITE_KERNELS")
    assert kernel_backend(torch.zeros(1)) == "torch"


def test_auto_does_not_launch_triton_on_cpu(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")

    def refuse(*args):
        raise AssertionError("the Triton path ran under auto on CPU")

    monkeypatch.setattr(FlashAttentionFunction, "apply", refuse)
    q = torch.randn(1, 5, 2, 16)
    assert flash_attention(q, q, q).shape == q.shape


@pytest.mark.parametrize("value", ["torch", "TORCH", " torch "])
def test_forced_torch(value, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", value)
    assert kernel_backend(torch.zeros(1)) == "torch"


def test_forced_triton_under_interpreter(device):
    if device.type != "cpu":
        pytest.skip("the interpreter is only enabled when the kernel tests run on CPU")
    assert kernel_backend(torch.zeros(1)) == "triton"
    assert kernel_backend() == "triton"


def test_forced_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel_backend(torch.zeros(1))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        q = torch.zeros(1, 4, 2, 16)
        flash_attention(q, q, q)


def test_unknown_value_is_an_error(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="MEGALITE_KERNELS"):
        kernel_backend()


def test_forced_triton_with_interpreter_enabled_too_late_says_why(monkeypatch):
    import megalite.kernels.dispatch as dispatch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "INTERPRETED_AT_IMPORT", False)
    with pytest.raises(RuntimeError, match="set after megalite.kernels was imported"):
        kernel_backend(torch.zeros(1))


def test_the_switch_is_read_once_per_process(monkeypatch):
    """A run reads MEGALITE_KERNELS on its first kernel call, not at every call; `use`
    switches it (the benchmarks), for this process and those it starts."""
    from megalite.kernels import dispatch

    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    assert kernel_backend(torch.zeros(1)) == "torch"
    os.environ["MEGALITE_KERNELS"] = "cuda"  # a later change of the variable goes unread
    assert kernel_backend(torch.zeros(1)) == "torch"
    dispatch.use("auto")
    assert kernel_backend(torch.zeros(1)) == "torch" and os.environ["MEGALITE_KERNELS"] == "auto"
