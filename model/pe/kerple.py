"""KERPLE (Chi et al. 2022): kernelized relative position biases, learned per head.

    kerple_log:    logits[h, i, j] += -r1_h * log(1 + r2_h * |i - j|)
    kerple_power:  logits[h, i, j] += -r1_h * |i - j| ^ r2_h,   0 < r2_h <= 2

As the reference code (chijames/KERPLE, megatron/mpu/layers.py, ParallelKerpleLog /
ParallelKerplePower with pos_emb ``kerple_log`` / ``kerple_power_ap_``):

- init r1, r2 ~ U(0, 2) and U(0, 1) for log (its ``bias_p``, ``bias_a``), and
  r1 ~ U(0, 1), r2 ~ U(0, 2) for power (``bias_a``, ``bias_p``): the multiplier and the
  exponent / log slope swap their ranges between the two;
- positivity is a projection, not a reparametrisation: at every forward the parameters
  are clamped in place to [eps, inf) (and the power exponent to [eps, 2]), eps = 0.01,
  before use; the gradient is the plain one at the projected value, so a parameter that an
  optimizer step pushed below eps is back at eps for the next forward and can move up again.
  Here the forward uses the projected values without writing the parameters (a write inside
  forward breaks FSDP's flat parameter views), with the plain gradient passed straight
  through, and ``project()`` writes them after every optimizer step (the harness calls it):
  the same values and gradients as the reference's;
- one module for all layers (the reference builds one and hands it to every layer).

The reference builds i - j for positions 0..T-1, where the visible part is i - j >= 0; the
paper's kernels are functions of |m - n|, which is what we use, so a visible key with a
larger position (packed documents reset positions) is penalised by its distance too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding, distance_bias

EPS = 1e-2  # the reference's lower bound for every KERPLE parameter


class _Kerple(PositionEncoding):
    bias_of_distance = True
    r1_init_high: float
    r2_init_high: float
    r2_max: float | None = None

    def __init__(self, config: GPTConfig, eps: float = EPS) -> None:
        super().__init__(config)
        if eps <= 0:
            raise ValueError(f"pe.eps must be positive, got {eps}")
        self.eps = eps
        # U(0, high) per head, as torch.rand(heads) * high in the reference
        self.r1 = nn.Parameter(torch.rand(config.n_head) * self.r1_init_high)
        self.r2 = nn.Parameter(torch.rand(config.n_head) * self.r2_init_high)
        self.project()

    def project(self) -> None:
        """Clamp the parameters into their range in place, after an optimizer step."""
        with torch.no_grad():
            self.r1.clamp_(min=self.eps)
            self.r2.clamp_(min=self.eps, max=self.r2_max)

    def projected(self) -> tuple[Tensor, Tensor]:
        """r1, r2 with the values clamped into range and the plain gradient passed through."""
        r1, r2 = self.r1, self.r2  # clamped values exactly (x - x is 0), gradient 1
        return (r1.detach().clamp(min=self.eps) + (r1 - r1.detach()),
                r2.detach().clamp(min=self.eps, max=self.r2_max) + (r2 - r2.detach()))

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        (r1, r2), kernel = self.projected(), self.kernel
        return distance_bias(lambda d: kernel(r1, r2, d.float().abs()[..., None]), q_positions, k_positions)

    def bias_score(self):
        (r1, r2), kernel = self.projected(), self.kernel
        return lambda q, k, head: kernel(r1[head], r2[head], (q - k).float().abs())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"


class KerpleLog(_Kerple, name="kerple_log"):
    r1_init_high, r2_init_high = 2.0, 1.0

    @staticmethod
    def kernel(r1: Tensor, r2: Tensor, distance: Tensor) -> Tensor:
        return -r1 * torch.log1p(r2 * distance)


class KerplePower(_Kerple, name="kerple_power"):
    r1_init_high, r2_init_high = 1.0, 2.0
    r2_max = 2.0  # the kernel |m - n|^p is conditionally positive definite only for p <= 2

    @staticmethod
    def kernel(r1: Tensor, r2: Tensor, distance: Tensor) -> Tensor:
        return -r1 * distance.pow(r2)
