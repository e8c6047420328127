"""train/mfu's peak (pelab.callbacks.device_peak, TokensPerSecond), on CPU with a faked CUDA
device name and precision. The reference is NVIDIA's datasheet figures as printed: tensor-core
rates "with sparsity" (2:4), whose dense rate is half (docs/gpu.md, MFU peaks)."""

from __future__ import annotations

import types

import pytest
import torch

import pelab.callbacks as callbacks

CUDA = torch.device("cuda")

# torch.cuda.get_device_name -> (NVIDIA's BF16/FP16 tensor-core TFLOP/s "with sparsity", its TF32 one)
DATASHEET_SPARSE = {
    "NVIDIA H100 80GB HBM3": (1979, 989),  # H100 SXM
    "NVIDIA H100 PCIe": (1513, 756),
    "NVIDIA H100 NVL": (1671, 835),
    "NVIDIA H200": (1979, 989),  # H200 SXM
    "NVIDIA H200 NVL": (1671, 835),
    "NVIDIA A100-SXM4-80GB": (624, 312),
    "NVIDIA A100 80GB PCIe": (624, 312),
}


@pytest.fixture
def device_name(monkeypatch):
    """Set the name torch.cuda.get_device_name reports (no CUDA needed)."""
    name = {"value": None}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["value"])

    def set_name(value: str) -> None:
        name["value"] = value

    return set_name


@pytest.mark.parametrize("name", sorted(DATASHEET_SPARSE))
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true", "16-true"])
def test_half_precision_is_looked_up_as_the_dense_tensor_core_peak(device_name, name, precision):
    device_name(name)
    flops, described = callbacks.device_peak(CUDA, precision)
    dense = DATASHEET_SPARSE[name][0] / 2 * 1e12
    assert flops == pytest.approx(dense, rel=1e-3)  # the datasheet rounds to whole TFLOP/s
    assert name in described and "dense" in described
    assert ("bf16" if precision.startswith("bf16") else "fp16") in described


@pytest.mark.parametrize("name", sorted(DATASHEET_SPARSE))
def test_float32_is_tf32_under_high_matmul_precision_and_plain_fp32_under_highest(device_name, name):
    device_name(name)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # what train.py sets on CUDA
        flops, described = callbacks.device_peak(CUDA, "32-true")
        assert flops == pytest.approx(DATASHEET_SPARSE[name][1] / 2 * 1e12, rel=2e-3) and "tf32" in described
        torch.set_float32_matmul_precision("highest")
        flops, described = callbacks.device_peak(CUDA, "32-true")
        assert flops < 70e12 and "fp32" in described  # CUDA cores: 19.5 (A100) to 67 (H100 SXM) TFLOP/s
    finally:
        torch.set_float32_matmul_precision(before)


def test_lightnings_table_would_have_been_wrong_for_these(device_name):
    """What this table replaces (lightning 2.6.x): 16-mixed looked up as float32, "NVIDIA H200"
    matched no key, H100 NVL's entry is a sparse figure. Here: dense, by the compute dtype."""
    device_name("NVIDIA H200")
    assert callbacks.device_peak(CUDA, "bf16-mixed")[0] == pytest.approx(989.5e12, rel=1e-3)
    device_name("NVIDIA H100 NVL")
    assert callbacks.device_peak(CUDA, "bf16-mixed")[0] == pytest.approx(835.5e12, rel=1e-3)
    device_name("NVIDIA H100 80GB HBM3")
    assert callbacks.device_peak(CUDA, "16-mixed")[0] == callbacks.device_peak(CUDA, "bf16-mixed")[0]


def test_other_chips_fall_back_to_lightnings_table_and_say_so(device_name, monkeypatch):
    asked = []

    def lightning_table(device, dtype):
        asked.append(dtype)
        return 65e12 if dtype == torch.float16 else None

    import lightning.fabric.utilities.throughput as throughput

    monkeypatch.setattr(throughput, "get_available_flops", lightning_table)
    device_name("Tesla T4")
    flops, described = callbacks.device_peak(CUDA, "16-mixed")
    assert asked == [torch.float16] and flops == 65e12 and "Lightning's table" in described
    assert callbacks.device_peak(CUDA, "bf16-mixed") is None  # neither table has it
    device_name("NVIDIA GH200 480GB")  # not an H200: "h200" must be a word of the name
    assert callbacks.device_peak(CUDA, "bf16-mixed") is None


def test_no_peak_on_cpu_or_in_float64(device_name):
    device_name("NVIDIA H100 80GB HBM3")
    assert callbacks.device_peak(torch.device("cpu"), "bf16-mixed") is None
    assert callbacks.device_peak(CUDA, "64-true") is None


def fit_start(callback, precision: str, device=CUDA):
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=device), precision=precision)
    callback.on_fit_start(trainer, None)


def test_the_callback_names_its_peak_once_and_divides_by_it(device_name, monkeypatch):
    printed = []
    monkeypatch.setattr(callbacks, "rank_zero_info", printed.append)
    device_name("NVIDIA H100 80GB HBM3")
    callback = callbacks.TokensPerSecond()
    fit_start(callback, "16-mixed")
    assert len(printed) == 1 and "989.4 TFLOP/s" in printed[0] and "H100 SXM, dense fp16" in printed[0]
    assert callback.peak in printed[0]

    # one log step on a CPU module (no synchronize): MFU = tokens x flops/token / seconds / peak
    clock = iter([0.0, 2.0, 2.0])
    monkeypatch.setattr(callbacks, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    logged = {}
    module = types.SimpleNamespace(device=torch.device("cpu"), flops_per_token=6e8,
                                   log=lambda name, value, **kw: logged.__setitem__(name, value))
    trainer = types.SimpleNamespace(global_step=0, log_every_n_steps=1, world_size=1)
    callback.on_train_start(trainer, module)
    trainer.global_step = 1
    batch = (torch.zeros(8, 1024, dtype=torch.long),)
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    assert logged["train/mfu"] == pytest.approx(8 * 1024 * 6e8 / 2.0 / 989.4e12)
    assert len(printed) == 1  # named at fit start only


def test_the_callback_says_when_it_logs_no_mfu(device_name, monkeypatch):
    printed = []
    monkeypatch.setattr(callbacks, "rank_zero_info", printed.append)
    import lightning.fabric.utilities.throughput as throughput

    monkeypatch.setattr(throughput, "get_available_flops", lambda device, dtype: None)
    device_name("Some Future GPU")
    callback = callbacks.TokensPerSecond()
    fit_start(callback, "bf16-mixed")
    assert callback.peak is None and len(printed) == 1 and "not logged" in printed[0]
    printed.clear()
    fit_start(callbacks.TokensPerSecond(), "bf16-mixed", device=torch.device("cpu"))
    assert printed == []  # CPU: nothing to say
