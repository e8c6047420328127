"""Attention temperature: a per-query scale c(p) of q, so the content logits q.k / sqrt(d) are
multiplied by c at the query's position p (a position bias, added after, is not scaled).
Applied in every layer it names, before the attention backend runs, so every backend (sdpa,
sdpa_key, flex, math, bias_grad), chunked evaluation and KV-cache decoding apply it alike.

- ``log_length`` (Chiang & Cholak 2022, "Overcoming a Theoretical Limitation of
  Self-Attention", sec. 5: attention logits multiplied by log n, n the input length, at
  training and test time). Causal form: n = p + 1, the number of keys query p sees, divided
  by log L so that the scale is 1 at n = L (L = ``attn_temperature_length``, default the
  training length): c(p) = ln(p + 1) / ln(L); every layer.
- ``llama4`` (Llama 4's ``attn_temperature_tuning``, Hugging Face's Llama4TextAttention):
  c(p) = 1 + attn_scale * ln(floor((p + 1) / floor_scale) + 1), attn_scale 0.1 and
  floor_scale 8192 by default; only in the layers without position information (Llama 4's
  NoPE layers: ``pe.nope_every``, or every layer of a scheme that acts outside attention).
  c = 1 until p + 1 reaches floor_scale, so small models need a smaller floor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TEMPERATURES = ("none", "log_length", "llama4")


def check_temperature(config, pe, nope_layers: frozenset[int]) -> None:
    """``model.attn_temperature=llama4`` needs a layer without position information."""
    if config.attn_temperature == "llama4" and not nope_layers and (pe.uses_rotate or pe.uses_bias):
        raise ValueError(f"model.attn_temperature must be none or log_length for pe={pe.name} with no NoPE layer "
                         f"(llama4 scales the queries of layers without position information: set pe.nope_every, "
                         f"or use a scheme without rotation or bias), got 'llama4'")


def query_scales(config, pe, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """(the scale for layers with the scheme, the scale for NoPE layers), each None or a
    float32-computed tensor in ``dtype`` that broadcasts over q (B, H, T, hd): (T, 1) for
    (T,) positions, (B, 1, T, 1) for per-sequence (B, T) ones."""
    kind = config.attn_temperature
    if kind == "none":
        return None, None
    n = positions.float() + 1
    if kind == "log_length":
        scale = n.log() / math.log(config.attn_temperature_length or config.block_size)
    else:  # llama4
        scale = 1 + config.attn_temperature_scale * torch.log1p(torch.floor(n / config.attn_temperature_floor))
    scale = (scale[:, None, :, None] if scale.dim() == 2 else scale[:, None]).to(dtype)
    no_position = not (pe.uses_rotate or pe.uses_bias)
    if kind == "llama4":
        return (scale if no_position else None), scale
    return scale, scale
