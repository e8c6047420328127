"""A bf16 run on a CPU that only emulates bf16 matmuls says so once, naming the faster setting."""

from types import SimpleNamespace

import pytest
import torch

from pelab.run import emulated_bf16_notice


def trainer(precision: str, device: str) -> SimpleNamespace:
    return SimpleNamespace(precision=precision, strategy=SimpleNamespace(root_device=torch.device(device)))


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_names_32_true(monkeypatch, native):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    notice = emulated_bf16_notice(trainer("bf16-mixed", "cpu"))
    if native:
        assert notice is None
    else:
        assert "trainer.precision=bf16-mixed" in notice and "trainer.precision=32-true" in notice


@pytest.mark.parametrize("precision,device", [("32-true", "cpu"), ("16-mixed", "cpu"), ("bf16-mixed", "meta")])
def test_other_precisions_and_devices_get_no_notice(monkeypatch, precision, device):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert emulated_bf16_notice(trainer(precision, device)) is None
