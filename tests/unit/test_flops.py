"""FLOPs and the peak behind MFU, without a run: the FLOPs formula against Narayanan et al.
2021's, the datasheet table by device name and dtype, the logging.peak_tflops override, an
unknown GPU said once with MFU null, and the CPU peak measured once per cache and key."""

import json

import pytest
import torch
from megalite.models.flops import flops_per_token

import megalite.hardware as flops
from megalite.config import ModelConfig, load_config
from megalite.errors import MegaliteError
from megalite.parallel_state import ParallelState
from megalite.training.metrics import StepCost


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Training FLOPs of one batch, Narayanan et al. 2021 (eq. 3, no recompute)."""
    return (
        72
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    )


@pytest.mark.parametrize(
    "layers, hidden, heads, seq, vocab",
    [
        (12, 768, 12, 1024, 50257),  # GPT-2 124M
        (24, 2048, 16, 2048, 51200),  # GPT-3 1.3B
        (96, 12288, 96, 2048, 51200),  # GPT-3 175B
        (105, 20480, 128, 2048, 51200),  # the 1T model of Narayanan et al.'s table 1
    ],
)
def test_flops_match_narayanan_et_al(layers, hidden, heads, seq, vocab):
    cfg = ModelConfig(
        arch="gpt", n_layers=layers, hidden=hidden, n_heads=heads, seq_len=seq, vocab_size=vocab
    )
    batch = 8
    counted = flops_per_token(cfg, causal=False) * batch * seq
    assert counted == pytest.approx(narayanan_flops(batch, seq, layers, hidden, vocab), rel=1e-12)
    # The causal mask skips half of the attention scores: 6 l h s per token fewer.
    skipped = counted / (batch * seq) - flops_per_token(cfg)
    assert skipped == pytest.approx(6 * layers * hidden * seq, rel=1e-12)


@pytest.mark.parametrize(
    "device_name, part",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA B200", "B200 (HGX, 1000 W)"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA GeForce GTX 1080", None),
        ("NVIDIA L40", None),  # not an L40S, nor an L4
    ],
)
def test_table_lookup_by_device_name(device_name, part):
    peak = flops.gpu_peak(device_name)
    assert (peak.name if peak else None) == part


@pytest.fixture
def float32_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_dense_figures_by_dtype(float32_matmul_precision):
    h100 = "NVIDIA H100 80GB HBM3"
    assert flops.gpu_peak_flops(h100, "bf16") == pytest.approx(989.4e12)  # never 1979 (sparse)
    assert flops.gpu_peak_flops("NVIDIA A100-SXM4-40GB", "fp16") == pytest.approx(312e12)
    float32_matmul_precision("high")  # fp32 matmuls as TF32
    assert flops.gpu_peak_flops(h100, "fp32") == pytest.approx(494.7e12)
    float32_matmul_precision("highest")
    assert flops.gpu_peak_flops(h100, "fp32") == pytest.approx(66.9e12)
    assert flops.gpu_peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None


@pytest.fixture
def no_measuring(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    flops.peak_flops.cache_clear()
    monkeypatch.setattr(flops, "measure_cpu_peak_flops", lambda p: pytest.fail("measured"))
    yield
    flops.peak_flops.cache_clear()


def test_peak_tflops_overrides_the_table_and_the_measurement(no_measuring):
    cfg = load_config(None, ["logging.peak_tflops=2.5"])
    cost = StepCost.of(cfg, ParallelState.single(torch.device("cpu")))
    assert (cost.devices, cost.device_peak_flops) == (1, 2.5e12)
    with pytest.raises(MegaliteError, match="logging.peak_tflops must be a positive number"):
        load_config(None, ["logging.peak_tflops=0"])


def test_an_fp8_run_says_its_mfu_is_against_the_compute_dtypes_peak(no_measuring, capsys):
    cfg = load_config(None, ["logging.peak_tflops=2.5", "train.fp8=rowwise"])
    cost = StepCost.of(cfg, ParallelState.single(torch.device("cpu")))
    assert cost.device_peak_flops == 2.5e12  # the fp32 peak given: float8 does not double it
    assert capsys.readouterr().out.splitlines() == [
        "train.fp8=rowwise: MFU is against the fp32 dense peak, not float8's (twice bf16's on "
        "H100 and H200)"
    ]


def test_an_unknown_gpu_is_said_once_and_has_no_mfu(no_measuring, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GTX 1080")
    cost = StepCost.of(load_config(None, []), ParallelState.single(torch.device("cuda", 0)))
    assert cost.device_peak_flops is None
    assert capsys.readouterr().out.splitlines() == [
        "unknown peak for NVIDIA GTX 1080: pass logging.peak_tflops=<dense TFLOP/s of one "
        "device> to get MFU (logged as null until then)"
    ]


def test_cpu_peak_is_measured_once_per_cache_and_key(monkeypatch, tmp_path):
    measured = []

    def measure(precision):
        measured.append(precision)
        return {"fp32": 5e10, "bf16": 2e10}[precision]

    monkeypatch.setattr(flops, "measure_cpu_peak_flops", measure)
    assert flops.cpu_peak_flops("fp32", tmp_path) == 5e10
    assert flops.cpu_peak_flops("fp32", tmp_path) == 5e10
    assert flops.cpu_peak_flops("bf16", tmp_path) == 2e10
    assert measured == ["fp32", "bf16"]
    cached = json.loads((tmp_path / flops.PEAK_CACHE_FILE).read_text())
    assert cached == {flops.cpu_peak_key("fp32"): 5e10, flops.cpu_peak_key("bf16"): 2e10}
    assert flops.cpu_peak_flops("fp32", tmp_path / "elsewhere") == 5e10
    assert measured == ["fp32", "bf16", "fp32"]  # another cache measures for itself
    (tmp_path / flops.PEAK_CACHE_FILE).write_text('{"half a fi')  # damaged: measured again
    assert flops.cpu_peak_flops("fp32", tmp_path) == 5e10
    assert measured == ["fp32", "bf16", "fp32", "fp32"]


def test_a_step_that_beats_the_measured_cpu_peak_raises_it(monkeypatch, tmp_path):
    """A peak measured while the cores were busy reads low; the first step that beats it sets
    the peak (here and in the machine's cache), so MFU never reads above 1 because of when the
    peak was taken. A datasheet or user-given peak is never changed."""
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    flops.peak_flops.cache_clear()
    monkeypatch.setattr(flops, "measure_cpu_peak_flops", lambda precision: 1e10)
    try:
        cost = StepCost.of(load_config(None, []), ParallelState.single(torch.device("cpu")))
    finally:
        flops.peak_flops.cache_clear()
    assert cost.peak_for(5e9) == 1e10
    assert cost.peak_for(3e10) == 3e10  # beaten: MFU of that step is exactly 1
    assert cost.peak_for(2e10) == 3e10
    assert flops.cpu_peak_flops("fp32", tmp_path) == 3e10  # the next run starts from it
    given = StepCost(tokens=1, flops=1.0, devices=1, device_peak_flops=1e10)
    assert given.peak_for(3e10) == 1e10


def test_a_slow_dtype_is_measured_on_a_smaller_product(monkeypatch):
    """Products that take over `slow` seconds stop the doubling: with 0 s the first, 256."""
    printed = []
    run = flops.subprocess.run

    def recording(*args, **kwargs):
        done = run(*args, **kwargs)
        printed.append(done.stdout.split())
        return done

    monkeypatch.setattr(flops.subprocess, "run", recording)
    assert flops.measure_cpu_peak_flops("fp32", repeats=1, slow=0.0) > 0
    assert printed[0][0] == "256"
