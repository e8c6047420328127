"""T5 relative position bias (Raffel et al. 2020), unidirectional (decoder) form.

logits[h, i, j] += table[bucket(n), h],  n = max(i - j, 0).

The bucket function is T5's ``_relative_position_bucket`` with bidirectional=False (mesh
TensorFlow, t5x, Hugging Face): with e = num_buckets // 2 exact buckets,

    bucket(n) = n                                                     if n < e
              = min(e + floor(ln(n / e) / ln(max_distance / e) * (num_buckets - e)),
                    num_buckets - 1)                                  otherwise,

so distances 0..e-1 have a bucket each, e..max_distance are spread log-uniformly over the
remaining buckets, and everything from max_distance on shares the last one. n is clipped at
0: a visible key whose position is larger than the query's (positions reset by packed
documents) is treated as distance 0, as T5's decoder does.

One (num_buckets, heads) table, shared by every layer (T5 computes the bias in the first
layer and reuses it). Init: t5x / flaxformer's ``variance_scaling(1.0, 'fan_avg',
'uniform')`` on the table, i.e. U(-a, a) with a = sqrt(6 / (heads + num_buckets)) (Glorot
uniform). Hugging Face's port draws N(0, d_model^-1/2) instead; we follow t5x, the code
behind T5.1.1 and later checkpoints. T5 does not scale q.k by 1/sqrt(d); here SDPA does and
the bias is added after that scaling, so the table is in logit units either way.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding, distance_bias


def t5_bucket(distance: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Bucket index (same shape, int64) of integer distances n = i - j; negatives map to 0."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    # float32 as the reference implementations; clamp so log never sees 0 (those n are exact)
    scaled = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = exact + (scaled * (num_buckets - exact)).long()  # .long() truncates = floor here (>= 0)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


class T5RelativeBias(PositionEncoding, name="t5"):
    bias_of_distance = True
    def __init__(self, config: GPTConfig, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__(config)
        if num_buckets < 2:
            raise ValueError(f"pe.num_buckets must be >= 2, got {num_buckets}")
        if max_distance <= num_buckets // 2:
            raise ValueError(f"pe.max_distance must exceed num_buckets // 2 = {num_buckets // 2}, got {max_distance}")
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, config.n_head)
        nn.init.xavier_uniform_(self.relative_attention_bias.weight)  # = t5x's fan_avg uniform

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        table, num_buckets, max_distance = self.relative_attention_bias, self.num_buckets, self.max_distance
        return distance_bias(lambda d: table(t5_bucket(d, num_buckets, max_distance)).float(),
                             q_positions, k_positions)  # (..., H, Tq, Tk)

    def bias_score(self):
        table, num_buckets, max_distance = self.relative_attention_bias.weight, self.num_buckets, self.max_distance
        return lambda q, k, head: table[t5_bucket(q - k, num_buckets, max_distance), head].float()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_buckets={self.num_buckets}, max_distance={self.max_distance}"
