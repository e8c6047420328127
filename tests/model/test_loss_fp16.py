"""The chunked loss under fp16 autocast with a scaled loss (``16-mixed``): its gradients are
formed before the loss scale applies, so they must not pass through fp16's range. Against a
float64 reference of the same logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.loss import chunked_cross_entropy

torch.set_num_threads(2)


def test_fp16_gradients_survive_the_loss_scale():
    g = torch.Generator().manual_seed(0)
    N, C, V = 2048, 32, 8192  # p / N ~ 6e-8: below fp16's smallest normal, at its smallest subnormal
    h = (torch.randn(N, C, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(V, C, generator=g) * 0.1).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g)
    scale = 2.0 ** 16  # GradScaler's initial scale
    with torch.autocast("cpu", dtype=torch.float16):
        loss = chunked_cross_entropy(h, w, targets, vocab_size=V)
    (loss * scale).backward()
    # reference: the fp16-rounded operands, everything else in float64
    h64 = h.detach().half().double().requires_grad_(True)
    w64 = w.detach().half().double().requires_grad_(True)
    F.cross_entropy(h64 @ w64.T, targets).backward()
    for name, got, want in (("hidden", h.grad / scale, h64.grad), ("weight", w.grad / scale, w64.grad)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 2e-3, f"{name}: relative error {rel:.3g}"
    zero_rows = int(((w.grad == 0).all(1) & (w64.grad != 0).any(1)).sum())
    assert zero_rows == 0, f"{zero_rows} vocabulary rows lost their gradient"
