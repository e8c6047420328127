"""Stick-breaking attention (``model.normaliser=stick_breaking``; Tan et al., ICLR 2025): the
softmax replaced by breaking a stick from the newest visible key backwards,

    A_ij = sigmoid(z_ij) * prod_{j<k<=i} (1 - sigmoid(z_ik)),    out_i = sum_j A_ij v_j,

z_ij the logit (q_i.k_j / sqrt(d) plus any position term). Each key takes its share of what the
later keys left, so the rows sum to at most 1 and the rest goes to nothing. Computed in log space
as the authors' reference (shawntan/stickbreaking-attention, ``sb_ref.py``): log A_ij =
logsigmoid(z_ij) + sum_{k>j} logsigmoid(-z_ik), the hidden keys adding nothing to the sum, so
documents and windows need no rule of their own. The query sees its own key (the reference's
``attend_current=True``); the remainder 1 - sum_j A_ij is not added back to the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

def stick_breaking_probabilities(logits: Tensor) -> Tensor:
    """(B, H, Tq, Tk) weights A of float logits with -inf on hidden keys; each row sums to <= 1."""
    visible = logits > float("-inf")
    z = logits.masked_fill(~visible, 0.0)  # finite everywhere, so no inf - inf in the backward
    log_take = F.logsigmoid(z).masked_fill(~visible, float("-inf"))
    log_pass = F.logsigmoid(-z).masked_fill(~visible, 0.0)
    # sum over the later keys k > j, as a shifted suffix sum: no total minus prefix cancellation
    later = F.pad(log_pass[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))
    return torch.exp(log_take + later)
