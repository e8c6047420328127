"""FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long
Context Transformers"): a learned function of the normalised distance, per head.

    logits[h, i, j] += f(psi(i - j) / psi(max(i, L)))_h,   psi(x) = log(|c x| + 1)

f is an MLP 1 -> width -> heads with a ReLU between, c a learned scalar (init 0.1) and
L = |m * L0| a learned threshold: L0 = the training length (``model.block_size``) is fixed
and the multiplier m (init 1) is learned. Dividing by psi(max(i, L)) maps every visible
distance into [0, 1] at any query position (progressive interpolation), and the threshold
keeps short prefixes from being stretched over the whole range.

Formula and constants as the paper's reference code (its appendix listing, reproduced in
several public ports): ``|c x|`` and ``|m L0|`` inside the logs (so c and m need no
positivity constraint: their sign does nothing), eps = 1e-6 added to the normaliser,
PyTorch's default ``nn.Linear`` init, one module shared by every layer. The paper's text
writes psi(x) = log(c x + 1) with c > 0; the code's absolute values also make the
masked part (i < j) finite. i is the query's position, so FIRE, unlike the other relative
schemes, also sees absolute position through the normaliser.

The bias is computed in float32 with autocast off: the MLP's Linear layers would otherwise
run in bf16 under mixed precision, and the bias must be float32 until the mask is cast.

FlexAttention under autograd reads ``bias()``, computed outside the kernel, once per score
(``flex_reads_bias``): the elementwise form ``bias_score`` reads every MLP weight once per
hidden unit, and Inductor's flex backward refuses a score_mod that indexes a tensor which
requires gradients more than once. ``bias_score`` serves flex without autograd (evaluation
at any length, no (H, T, T) tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding, distance_bias, relative_distance


class FIRE(PositionEncoding, name="fire"):
    # flex under autograd reads bias() once per score instead of bias_score (model/attention/flex.py)
    flex_reads_bias = True

    def __init__(
        self,
        config: GPTConfig,
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_threshold: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        super().__init__(config)
        if mlp_width < 1:
            raise ValueError(f"pe.mlp_width must be >= 1, got {mlp_width}")
        threshold = float(config.block_size if init_threshold is None else init_threshold)
        if init_c <= 0 or threshold <= 0 or eps <= 0:
            raise ValueError(f"pe.init_c, pe.init_threshold and pe.eps must be positive, got "
                             f"{init_c}, {init_threshold}, {eps}")
        self.mlp = nn.Sequential(nn.Linear(1, mlp_width), nn.ReLU(), nn.Linear(mlp_width, config.n_head))
        # c and m are scalars stored with shape (1,): FSDP flattens parameters and refuses 0-dim ones
        self.c = nn.Parameter(torch.tensor([float(init_c)]))
        self.register_buffer("init_threshold", torch.tensor(threshold))  # L0: fixed, saved with the model
        self.threshold_multiplier = nn.Parameter(torch.tensor([1.0]))
        self.eps = eps

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("c", "threshold_multiplier"):  # checkpoints before the (1,) shape held 0-dim tensors
            key = prefix + name
            if key in state_dict and state_dict[key].dim() == 0:
                state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def threshold(self) -> Tensor:
        return (self.threshold_multiplier[0] * self.init_threshold).abs()

    def psi(self, x: Tensor) -> Tensor:
        """log(|c x| + 1) of a float32 tensor."""
        return torch.log(torch.abs(self.c[0] * x) + 1)

    def normalized_distance(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """(..., Tq, Tk) float32 psi(i - j) / psi(max(i, L))."""
        normalizer = self.psi(torch.maximum(q_positions.float(), self.threshold)) + self.eps
        return self.psi(relative_distance(q_positions, k_positions)) / normalizer[..., :, None]

    def head_values(self, x: Tensor) -> Tensor:
        """f(x): (...) normalised distances -> (..., H)."""
        return self.mlp(x[..., None].to(self.mlp[0].weight.dtype))

    def bias_of_distance_at(self, q_positions: Tensor) -> bool:
        """Whether the bias at these query positions is a function of p_i - p_j alone: every query
        below L, so every row's normaliser is psi(L) (read on the host)."""
        return bool((q_positions.float() < self.threshold).all())

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        with torch.autocast(q_positions.device.type, enabled=False):
            if not torch.compiler.is_compiling() and self.bias_of_distance_at(q_positions):
                # a training window: every query below L, so the normaliser is psi(L) on every
                # row and the bias depends on i - j alone; the MLP then runs once per distance,
                # not once per (i, j) pair
                normalizer = self.psi(self.threshold) + self.eps
                return distance_bias(lambda d: self.head_values(self.psi(d.float()) / normalizer),
                                     q_positions, k_positions)
            out = self.head_values(self.normalized_distance(q_positions, k_positions))  # (..., Tq, Tk, H)
        return out.movedim(-1, -3)

    def bias_score(self):
        """Elementwise form: the MLP unrolled over its hidden units (pointwise ops only, so
        a compiled FlexAttention kernel can inline it), in float32. Forward only: it indexes
        the weights once per hidden unit, which flex's backward refuses (``flex_reads_bias``).
        The threshold is captured with shape (1,): torch 2.11's flex lowering fails on a 0-dim
        captured tensor."""
        psi, eps = self.psi, self.eps
        threshold = self.threshold.reshape(1)
        w1, b1 = self.mlp[0].weight[:, 0].float(), self.mlp[0].bias.float()
        w2, b2 = self.mlp[2].weight.float(), self.mlp[2].bias.float()

        def score(q: Tensor, k: Tensor, head: Tensor) -> Tensor:
            x = psi((q - k).float()) / (psi(torch.maximum(q.float(), threshold[0])) + eps)
            out = b2[head]
            for u in range(w1.shape[0]):
                out = out + torch.relu(x * w1[u] + b1[u]) * w2[head, u]
            return out

        return score

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps}"
