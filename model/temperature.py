"""Attention temperature: a per-query scale c of q, so the content logits q.k / sqrt(d) are
multiplied by c (a position bias, added after, is not scaled). Applied in every layer it names,
before the attention backend runs, so every backend (sdpa, sdpa_key, flex, math, bias_grad),
chunked evaluation and KV-cache decoding apply it alike. c is computed in float32, q is
multiplied by it in float32 and the product cast to q's dtype (Hugging Face Llama 4's order).
No kind reads position values: randomized positions (``pe.randomize_to``) and positions that
restart per document change nothing.

- ``log_length`` (Chiang & Cholak 2022, "Overcoming a Theoretical Limitation of
  Self-Attention", sec. 5: attention logits multiplied by log n, n the input length, at
  training and test time). Causal form: n = the number of keys the query sees (token i of a
  window after ``past`` cached tokens: past + i + 1; under a document mask, its index in its
  document + 1), divided by log L so that the scale is 1 at n = L (L =
  ``attn_temperature_length``, default the training length): c = ln(n) / ln(L); every layer.
- ``logn`` (Qwen's ``use_logn_attn``, QwenLM/Qwen ``modeling_qwen.py``: ``logn_list``, the
  form SWAN-GPT's inference-time scaling takes): c = max(1, ln n / ln L), n and L as
  ``log_length``'s. c = 1 for every query within the training length, so a model trained with it
  trains as one without it (bit for bit): the scaling acts only past L, at inference.
- ``llama4`` (Llama 4's ``attn_temperature_tuning``, Hugging Face's Llama4TextAttention):
  c = 1 + attn_scale * ln(floor((t + 1) / floor_scale) + 1) of the token index t = past + i
  (HF's ``cache_position``: packed documents and position ids do not reset it), attn_scale
  0.1 and floor_scale 8192 by default; only in the layers without position information
  (Llama 4's NoPE layers: ``pe.nope_every``, or every layer of a scheme that acts outside
  attention). c = 1 until t + 1 reaches floor_scale, so small models need a smaller floor.
- ``ssmax`` (Nakanishi 2025, "Scalable-Softmax Is Superior for Attention", arXiv 2501.19399:
  softmax of (s ln n) z, implemented by scaling q): c = s_h * ln(n), n as ``log_length``'s,
  s_h one learned scalar per head and layer (the paper's "for each layer and head"), every layer.
  s_h starts at 1 / mean(ln n) over n = 1..L (the paper's 0.168 at its L = 1024), so that the
  average scale over a training window is 1; L = ``attn_temperature_length`` or the training
  length. No reference code of the paper's was found: this follows its equation, q times s ln n.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

TEMPERATURES = ("none", "log_length", "logn", "llama4", "ssmax")
KEYS_SEEN = ("log_length", "logn", "ssmax")  # the kinds that count the keys a query sees (so: not with windows)
TEMPERATURE_LAYERS = ("all", "global")  # model.attn_temperature_layers: every layer, or the full-attention ones


def check_temperature(config, pe, nope_layers: frozenset[int]) -> None:
    """``model.attn_temperature=llama4`` needs a layer without position information."""
    if config.attn_temperature == "llama4" and not nope_layers and (pe.uses_rotate or pe.uses_bias):
        raise ValueError(f"model.attn_temperature must be none, log_length, logn or ssmax for pe={pe.name} with no NoPE "
                         f"layer (llama4 scales the queries of layers without position information: set pe.nope_every, "
                         f"or use a scheme without rotation or bias), got 'llama4'")


def check_init_temperature(run: str, source: str, path) -> None:
    """``init_from``: ssmax's learned s_h must exist on both sides or on neither (no weight to load or to drop)."""
    if (run == "ssmax") != (source == "ssmax"):
        allowed = "'ssmax'" if source == "ssmax" else "not 'ssmax'"
        raise ValueError(f"model.attn_temperature must be {allowed} with init_from={path} (trained with "
                         f"attn_temperature={source!r}: ssmax's learned per-head s_h live in the weights), got {run!r}")


def ssmax_init(length: int) -> float:
    """SSMax's initial s: 1 / mean(ln n) over n = 1..length = length / ln(length!)."""
    return length / math.lgamma(length + 1)


def head_scales(config, layer: int = 0) -> nn.Parameter | None:
    """Layer ``layer``'s learned per-head factor of its query scale (``ssmax``'s s_h, one per query
    head: (n_head,), or (2 n_head,) with differential attention; float32), else None (another kind,
    or a layer the temperature leaves: attn_temperature_layers)."""
    if config.attn_temperature != "ssmax" or not config.temperature_layers[layer]:
        return None
    s = ssmax_init(config.attn_temperature_length or config.block_size)
    return nn.Parameter(torch.full((config.query_heads,), s))


def scale_queries(q: Tensor, q_scale: Tensor, heads: Tensor | None = None) -> Tensor:
    """q (B, H, T, hd) times the per-query scale (and the per-head ``heads``) in float32, cast back to q's dtype."""
    if heads is not None:  # (H, 1, 1) x (T, 1) or (B, 1, T, 1)
        q_scale = heads[:, None, None] * q_scale
    return (q * q_scale).to(q.dtype)


def keys_seen(T: int, past: int, documents: Tensor | None, device: torch.device) -> Tensor:
    """The number of keys each of T queries sees: (T,) past + 1.. past + T, or with (B, T)
    document ids (no cache) (B, T) counts of the earlier tokens of the query's document, itself
    included (ids in any order: a stable sort groups each document's tokens in token order)."""
    if documents is None:
        return torch.arange(past + 1, past + T + 1, device=device)
    ids, order = documents.sort(dim=-1, stable=True)
    index = torch.arange(T, device=device).expand_as(ids)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rank = index - torch.where(first, index, 0).cummax(dim=-1).values  # earlier tokens of the document
    return torch.empty_like(rank).scatter_(-1, order, rank) + 1


def query_scales(config, pe, positions: Tensor, past: int = 0, documents: Tensor | None = None
                 ) -> tuple[Tensor | None, Tensor | None]:
    """(the scale for layers with the scheme, the scale for NoPE layers), each None or a float32
    tensor that broadcasts over q (B, H, T, hd): (T, 1), or (B, 1, T, 1) under a document mask
    (``log_length``, ``logn``, ``ssmax``: ln n, times each layer's s_h in ``scale_queries``). ``positions``:
    the T queries' (only their number and device are read); ``past``: tokens already in the KV
    cache; ``documents``: (B, T) document ids or None."""
    kind = config.attn_temperature
    if kind == "none":
        return None, None
    T, device = positions.shape[-1], positions.device
    if kind in KEYS_SEEN:
        n = keys_seen(T, past, documents, device).float()
        scale = n.log()
        if kind in ("log_length", "logn"):
            scale = scale / math.log(config.attn_temperature_length or config.block_size)
        if kind == "logn":
            scale = scale.clamp_min(1.0)
    else:  # llama4, as Hugging Face: log1p(floor((t + 1) / F)) * a + 1 in float32, t the token index
        t = torch.arange(past, past + T, device=device).float()
        floor, a = config.attn_temperature_floor, config.attn_temperature_scale
        scale = torch.log1p(torch.floor((t + 1.0) / floor)) * a + 1.0
    scale = scale[:, None, :, None] if scale.dim() == 2 else scale[:, None]
    no_position = not (pe.uses_rotate or pe.uses_bias)
    if kind == "llama4":
        return (scale if no_position else None), scale
    return scale, scale
