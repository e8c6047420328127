"""A nanoGPT-style decoder whose position information comes from a pluggable scheme.

The scheme (model/pe/) is asked for its hooks; nothing here branches on its name.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.bias_grad import attention_with_bias_grad
from model.config import GPTConfig
from model.loss import chunked_cross_entropy, use_chunked_loss
from model.pe.base import PositionEncoding


def uncompiled(model: nn.Module) -> nn.Module:
    """The eager module behind a ``torch.compile`` wrapper (evaluation probes must not be traced)."""
    return getattr(model, "_orig_mod", model)


def causal_future(Tq: int, Tk: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool, True where key j comes after query i in token order, the queries being
    the last Tq of the Tk tokens. Causality is decided by order, never by position values:
    packed documents, randomized positions and cache offsets repeat or reset positions."""
    q_index = torch.arange(Tk - Tq, Tk, device=device)
    return torch.arange(Tk, device=device)[None, :] > q_index[:, None]


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """(B, 1) next token ids from (B, V) logits: greedy at temperature 0, else softmax
    sampling restricted to the ``top_k`` most likely and the smallest set with ``top_p`` mass."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token already >= p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


class QueryChunks:
    """Evaluate attention in query chunks of ``size``; ``mask`` builds each chunk's float mask."""

    def __init__(self, size: int, mask=None) -> None:
        self.size, self.mask = size, mask

    def bounds(self, T: int):
        return ((s, min(T, s + self.size)) for s in range(0, T, self.size))


class AttentionRecorder:
    """Collects the attention probabilities of the ``math`` backend, layer by layer in
    forward order: {layer: (B, H, Tq, Tk) float32} for the layers in ``layers`` (None: all)."""

    def __init__(self, layers: set[int] | None = None) -> None:
        self.layers, self.probs, self.calls = layers, {}, 0

    def add(self, probs: Tensor) -> None:
        if self.layers is None or self.calls in self.layers:
            self.probs[self.calls] = probs.detach()
        self.calls += 1


@dataclass
class PositionContext:
    """What every layer of one forward shares, computed once per forward: the scheme, its
    rotation tables (cos/sin, decays) and how attention adds the position terms, per backend:

    - ``sdpa``: ``mask``, the float32 (bias + causal -inf) mask, or None = the causal kernel;
    - ``sdpa_key``: ``key_bias``, the key-only term m_h (j - j_ref) of an ALiBi-type bias as
      features of the keys (see ``key_features``), the causal kernel;
    - ``flex``: ``score``, the scheme's elementwise bias (None: causal only);
    - ``math``: ``mask`` always present, probabilities optionally recorded.

    ``chunk``: a long evaluation in query chunks (the (H, T, T) terms never exist at once)."""

    pe: PositionEncoding
    positions: Tensor  # (T,) or (B, T) of the tokens (queries) in this forward
    tables: Any = None
    mask: Tensor | None = None
    chunk: QueryChunks | None = None
    backend: str = "sdpa"
    k_positions: Tensor | None = None  # every key's position (cache + these tokens); None = positions
    key_bias: Tensor | None = None
    score: Any = None
    block_masks: dict | None = None  # flex: causal BlockMasks per (Tq, Tk, device), owned by the model
    record: AttentionRecorder | None = None


class LayerCache:
    """One layer's cached keys (rotated once, at their own positions) and values."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v


class KVCache:
    """Keys and values of every layer for incremental decoding. ``span`` is every position
    the generation will cover, fixed up front: schemes whose tables depend on the context
    (xPos's reference point, dynamic NTK's length) read it, so cached keys stay valid and
    decoding equals one full forward over the final sequence."""

    def __init__(self, n_layer: int, span: Tensor) -> None:
        self.span = span
        self.positions = span[:0]
        self.layers = [LayerCache() for _ in range(n_layer)]

    @property
    def length(self) -> int:
        return self.positions.shape[-1]


# ---------------------------------------------------------------------------------------
# attention backends: every one adds the scheme's position terms in float32
# ---------------------------------------------------------------------------------------

# bf16 pieces whose float32 sum is exactly a float32 value (8 + 8 + 8 significand bits).
# q, k, v of the key-only path are padded to one head dim, a multiple of this: 8 for CUDA's
# flash kernels; none on CPU, where padding 32 + 3 to 40 dims measured 1.4x slower than 35.
KEY_PAD_MULTIPLE = {"cuda": 8}
KEY_PIECES = {torch.float32: 1, torch.float64: 1, torch.bfloat16: 3}


def split_exact(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., n) pieces of float32 ``x`` in ``dtype`` that sum back to ``x`` exactly in float32:
    each piece is the rounding of what the earlier ones left (an exact float32 difference)."""
    pieces, rest = [], x
    for _ in range(KEY_PIECES[dtype]):
        piece = rest.to(dtype)
        pieces.append(piece)
        rest = rest - piece.float()
    return torch.stack(pieces, dim=-1)


def key_features(slopes: Tensor, k_positions: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """(1 or B, H, Tk, n) key features of the key-only form of an ALiBi-type bias -m_h (i - j).

    Under a causal softmax any term constant along a query's row drops out: -m_h i, and
    -m_h j_ref with j_ref the last key's position (it keeps the terms small). What is left,
    m_h (j - j_ref), depends on the key alone. It rides inside q.k: k gets these features,
    q gets ones, and SDPA's ``scale`` = 1/sqrt(head_dim) multiplies both parts, so the
    features carry m_h (j - j_ref) sqrt(head_dim), computed in float32 and split into pieces
    exactly representable in the compute dtype (three for bf16: the full float32 value)."""
    kp = k_positions if k_positions.dim() == 2 else k_positions[None]
    relative = (kp - kp[:, -1:]).float()  # exact integers
    term = slopes.float()[None, :, None] * relative[:, None, :] * math.sqrt(head_dim)
    return split_exact(term, dtype)


def _causal(Tq: int, Tk: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA: the queries are the last Tq of the Tk tokens."""
    if Tq == Tk:
        return None, True
    if Tq == 1:  # one new token after a cache: every key is visible
        return None, False
    return ~causal_future(Tq, Tk, device), False


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool,
          scale: float | None = None) -> Tensor:
    """SDPA in the compute dtype of v with a float32 mask added in float32: autocast is off
    here because it would cast the mask to bf16 (q, k, v already are)."""
    with torch.autocast(v.device.type, enabled=False):
        q, k = q.to(v.dtype), k.to(v.dtype)
        if mask is not None and mask.requires_grad and v.device.type == "cpu" and not dropout \
                and torch.is_grad_enabled():  # a learned bias: SDPA would fall back to float32 math
            return attention_with_bias_grad(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              scale=scale)


def _sdpa_key(q: Tensor, k: Tensor, v: Tensor, features: Tensor, dropout: float) -> Tensor:
    """The key-only path: [q, 1] . [k, features] with the original 1/sqrt(head_dim) scale;
    q, k, v padded to one head dim (v with zeros) so SDPA keeps its fused kernel."""
    B, H, Tq, D = q.shape
    Tk, n = k.shape[2], features.shape[-1]
    pad = -(D + n) % KEY_PAD_MULTIPLE.get(q.device.type, 1)
    dtype = v.dtype
    q = torch.cat((q.to(dtype), q.new_ones(B, H, Tq, n, dtype=dtype)), dim=-1)
    k = torch.cat((k.to(dtype), features.to(dtype).expand(B, H, Tk, n)), dim=-1)
    if pad:
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
    v = F.pad(v, (0, n + pad))
    mask, causal = _causal(Tq, Tk, q.device)
    return _sdpa(q, k, v, mask, dropout, causal, scale=1.0 / math.sqrt(D))[..., :D]


# ``auto`` on CPU for schemes with a key-only form: sdpa_key (True) or the float32 mask (False),
# whichever measured faster on CPU (docs/design.md, section 5).
AUTO_CPU_KEY_ONLY = False

_flex_compiled = None
# Compiled flex specialises on every (batch, Tq, Tk): an evaluation sweep (lengths x query
# chunks x batch sizes) passes dynamo's default limit of 8 per function, past which flex runs
# unfused and materialises the scores.
FLEX_RECOMPILE_LIMIT = 64


def flex_compiled(q: Tensor, k: Tensor, v: Tensor, score_mod, block_mask) -> Tensor:
    """``flex_attention`` compiled once per process, one kernel per shape (the CUDA path)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _flex_compiled
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        return _flex_compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _flex(q: Tensor, k: Tensor, v: Tensor, score, q_positions: Tensor, k_positions: Tensor, block_mask) -> Tensor:
    """FlexAttention with the scheme's elementwise bias as ``score_mod`` (float32: the kernel's
    scores are float32) and a causal BlockMask. Compiled on CUDA; eager elsewhere (CPU:
    forward only in torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    B = q.shape[0]
    score_mod = None
    if score is not None:
        qp = (q_positions if q_positions.dim() == 2 else q_positions[None]).expand(B, -1)
        kp = (k_positions if k_positions.dim() == 2 else k_positions[None]).expand(B, -1)

        def score_mod(s, b, h, q_idx, kv_idx):
            return s + score(qp[b, q_idx], kp[b, kv_idx], h)

    dtype = v.dtype
    with torch.autocast(v.device.type, enabled=False):
        if v.device.type == "cuda" and not torch.compiler.is_compiling():
            return flex_compiled(q.to(dtype), k.to(dtype), v, score_mod, block_mask)
        with warnings.catch_warnings():  # eager flex warns that it is not the fused kernel
            warnings.simplefilter("ignore")
            return flex_attention(q.to(dtype), k.to(dtype), v, score_mod=score_mod, block_mask=block_mask)


def causal_block_mask(cache: dict, Tq: int, Tk: int, device: torch.device):
    """The causal BlockMask of Tq queries (the last of Tk tokens) against Tk keys, built once
    per (Tq, Tk, device) and kept in ``cache``."""
    key = (Tq, Tk, str(device))
    if key not in cache:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = Tk - Tq
        cache[key] = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset, None, None, Tq, Tk,
                                       device=device)
    return cache[key]


def _math(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(d) + mask) v with the probabilities materialised, in float32."""
    with torch.autocast(v.device.type, enabled=False):
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        probs = torch.softmax(scores + mask, dim=-1)
        dropped = F.dropout(probs, dropout) if dropout else probs
        return torch.matmul(dropped, v.float()).to(v.dtype), probs


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: PositionContext, dropout: float = 0.0) -> Tensor:
    """(B, H, Tq, hd) attention output of queries that are the last Tq of the Tk keys, with
    the context's backend and position terms, in query chunks when the context has them."""
    Tq, Tk = q.shape[2], k.shape[2]
    k_positions = ctx.positions if ctx.k_positions is None else ctx.k_positions
    spans = [(0, Tq)] if ctx.chunk is None else list(ctx.chunk.bounds(Tq))
    parts, probs = [], []
    for s, e in spans:
        ke = Tk - Tq + e  # chunk [s, e) attends to keys [0, ke)
        qs, ks, vs = (q, k, v) if (s, e) == (0, Tq) else (q[:, :, s:e], k[:, :, :ke], v[:, :, :ke])
        mask = ctx.mask
        if ctx.chunk is not None and ctx.chunk.mask is not None:
            mask = ctx.chunk.mask(ctx.positions[..., s:e], k_positions[..., :ke])
        if ctx.backend == "sdpa":
            parts.append(_sdpa(qs, ks, vs, mask, dropout, causal=mask is None and e - s == ke))
        elif ctx.backend == "sdpa_key":
            parts.append(_sdpa_key(qs, ks, vs, ctx.key_bias[..., :ke, :], dropout))
        elif ctx.backend == "flex":
            block_mask = causal_block_mask(ctx.block_masks, e - s, ke, q.device)
            parts.append(_flex(qs, ks, vs, ctx.score, ctx.positions[..., s:e], k_positions[..., :ke], block_mask))
        elif ctx.backend == "math":
            y, p = _math(qs, ks, vs, mask, dropout)
            parts.append(y)
            probs.append(F.pad(p, (0, Tk - ke)))
        else:
            raise ValueError(f"unknown attention backend {ctx.backend!r}")
    if ctx.record is not None and probs:
        ctx.record.add(torch.cat(probs, dim=2))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def qkv(self, x: Tensor, ctx: PositionContext) -> tuple[Tensor, Tensor, Tensor]:
        """Heads-first (B, H, T, hd) q, k, v with the scheme's rotation applied."""
        B, T, C = x.shape
        # split + transpose views: their backward is one cat into the c_attn gradient, where a
        # (3, B, H, T, hd) permute's is a stack plus a copy (~1% of a tiny CPU step)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if ctx.tables is not None:
            q, k = ctx.pe.apply_rotation(q, k, ctx.tables)
        return q, k, v

    def forward(self, x: Tensor, ctx: PositionContext, cache: LayerCache | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x, ctx)
        if cache is not None:
            k, v = cache.append(k, v)
        dropout = self.dropout if self.training else 0.0
        y = attend(q, k, v, ctx, dropout)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, ctx: PositionContext, cache: LayerCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), ctx, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, pe: PositionEncoding, nope_layers: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.config = config
        self.nope_layers = frozenset(nope_layers)  # layers that attend with no position information
        self.pe = pe  # shared by all layers; its tables are computed once per forward where possible
        self._block_masks: dict = {}  # flex: causal BlockMasks per (Tq, Tk, device)
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying (GPT-2)

        # GPT-2 init for the network; a scheme initialises its own parameters (a T5 bucket
        # table or a FIRE MLP has its own rule), so the scheme's modules are left alone.
        for module in (self.wte, self.blocks, self.ln_f, self.lm_head):
            module.apply(self._init_weights)
        # GPT-2: scale residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.blocks.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.pe.parameters())
        return n

    def attention_mask(
        self, q_positions: Tensor, k_positions: Tensor, dtype: torch.dtype, always: bool = False,
        with_bias: bool = True,
    ) -> Tensor | None:
        """Float mask (1 or B, H, Tq, Tk): the scheme's bias plus -inf on keys after the query.

        The Tq queries are the last Tq of the Tk tokens (a query chunk, or new tokens after
        a cache). None when the scheme has no bias (SDPA's is_causal is faster), unless
        ``always``. ``with_bias=False``: the causal part only (NoPE layers). ``dtype``: the
        mask's; the model always asks float32, so the position terms keep float32 accuracy
        whatever the compute dtype (a bf16 mask would round a bias of -16 to steps of 0.125).
        """
        future = causal_future(q_positions.shape[-1], k_positions.shape[-1], q_positions.device)
        if self.pe.uses_bias and with_bias:
            bias = self.pe.bias(q_positions, k_positions)
        elif always:
            bias = torch.zeros(future.shape, device=future.device).expand(self.config.n_head, -1, -1)
        else:
            return None
        mask = bias.masked_fill(future, float("-inf")).to(dtype)
        return mask if mask.dim() == 4 else mask.unsqueeze(0)  # (B or 1, H, Tq, Tk)

    def position_context(self, positions: Tensor, mask: Tensor | None = None, span: Tensor | None = None
                         ) -> PositionContext:
        """The per-forward context of tokens at ``positions``: the scheme's rotation tables
        (over ``span``, default the positions themselves) and ``mask``."""
        tables = None
        if self.pe.uses_rotate:
            tables = self.pe.rotation_tables(positions, positions if span is None else span)
        return PositionContext(self.pe, positions, tables, mask)

    def attention_backend(self, device: torch.device, backend: str | None = None,
                          dtype: torch.dtype = torch.float32) -> str:
        """The backend a forward on ``device`` uses: ``backend`` or ``model.attention``, with
        ``auto`` resolved (docs/design.md, section 5). ``sdpa_key`` stands only for schemes
        with a key-only form (and a dtype it is exact in); other schemes get ``sdpa``."""
        name = backend or self.config.attention
        if name == "auto":
            if not self.pe.uses_bias:
                name = "sdpa"
            elif self.pe.key_only_slopes() is not None:
                name = "sdpa_key" if device.type == "cuda" or AUTO_CPU_KEY_ONLY else "sdpa"
            elif device.type == "cuda" and (self.config.dropout == 0 or not self.training):
                name = "flex"
            else:
                name = "sdpa"
        if name == "sdpa_key" and (self.pe.key_only_slopes() is None or dtype not in KEY_PIECES):
            name = "sdpa"
        return name

    def layer_contexts(self, positions: Tensor, k_positions: Tensor | None = None, span: Tensor | None = None,
                       dtype: torch.dtype = torch.float32, q_chunk: int | None = None, always_mask: bool = False,
                       backend: str | None = None, record: AttentionRecorder | None = None
                       ) -> list[PositionContext]:
        """One forward's per-layer contexts, built once: the scheme's (tables and the position
        terms of the backend, or query chunks) and, for NoPE layers of a schedule, a
        causal-only one. ``dtype``: the compute dtype; masks are float32 whatever it is."""
        k_positions = positions if k_positions is None else k_positions
        T = positions.shape[-1]
        kind = self.attention_backend(positions.device, backend, dtype)
        chunked = q_chunk is not None and T > q_chunk
        score = None
        if kind == "flex" and self.pe.uses_bias:
            score = self.pe.bias_score()
            if score is None:
                raise ValueError(f"model.attention=flex: pe={self.pe.name} gives no elementwise bias (bias_score)")

        def build(with_pe: bool) -> PositionContext:
            ctx = self.position_context(positions, span=k_positions if span is None else span) if with_pe \
                else PositionContext(self.pe, positions)
            ctx.k_positions, ctx.record = k_positions, record
            ctx.backend = kind if with_pe or kind in ("flex", "math") else "sdpa"
            if ctx.backend in ("sdpa", "math"):
                always = always_mask or ctx.backend == "math"
                if chunked:
                    ctx.chunk = QueryChunks(q_chunk, lambda qp, kp: self.attention_mask(
                        qp, kp, torch.float32, always=True, with_bias=with_pe))
                else:
                    ctx.mask = self.attention_mask(positions, k_positions, torch.float32, always=always,
                                                   with_bias=with_pe)
                return ctx
            if chunked:
                ctx.chunk = QueryChunks(q_chunk)
            if ctx.backend == "sdpa_key":
                ctx.key_bias = key_features(self.pe.key_only_slopes(), k_positions, self.config.head_dim, dtype)
            else:  # flex
                ctx.score, ctx.block_masks = (score if with_pe else None), self._block_masks
            return ctx

        scheme = build(True)
        plain = build(False) if self.nope_layers else scheme
        return [plain if i in self.nope_layers else scheme for i in range(len(self.blocks))]

    def positions_for(self, T: int, positions: Tensor | None, device: torch.device, start: int = 0) -> Tensor:
        """The default start..start+T-1, checked against the scheme's table; or validated explicit ones."""
        if positions is None:
            limit = self.pe.max_positions
            if limit is not None and start + T > limit:
                raise ValueError(
                    f"sequence length {start + T} exceeds the {limit} positions of pe={self.pe.name}; "
                    f"this scheme cannot run past its table"
                )
            return torch.arange(start, start + T, device=device)
        if positions.shape[-1:] != (T,) or positions.dim() > 2:
            raise ValueError(f"positions must have shape ({T},) or (batch, {T}), got {tuple(positions.shape)}")
        return positions

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        x = self.wte(idx)
        if self.pe.uses_embed:
            x = self.pe.embed(x, positions)
        return self.drop(x)

    def hidden(self, idx: Tensor, positions: Tensor | None = None, q_chunk: int | None = None,
               cache: KVCache | None = None, span: Tensor | None = None, attention: str | None = None,
               record: AttentionRecorder | None = None) -> Tensor:
        """Final normalised hidden states (B, T, C). ``q_chunk`` bounds attention memory for
        long evaluation sequences (see QueryChunks); training leaves it None. With ``cache``
        the tokens continue the cached ones (positions default to the next ones) and their
        keys and values are appended to it. ``span``: every position of the attention context
        (default: the cache's, else these positions) for span-dependent schemes.
        ``attention``: a backend for this call instead of ``model.attention``; ``record``
        collects the attention probabilities (``math`` backend)."""
        T = idx.shape[1]
        past = 0 if cache is None else cache.length
        positions = self.positions_for(T, positions, idx.device, start=past)
        k_positions = positions if cache is None else torch.cat((cache.positions, positions), dim=-1)
        if span is None:
            span = k_positions if cache is None else cache.span
        dtype = self._compute_dtype(idx.device)
        x = self.embed(idx, positions)
        contexts = self.layer_contexts(positions, k_positions, span, dtype, q_chunk if cache is None else None,
                                       always_mask=past > 0 and T > 1,  # several new tokens after a cache
                                       backend=attention, record=record)
        for block, ctx, layer_cache in zip(self.blocks, contexts, cache.layers if cache is not None else [None] * len(contexts)):
            x = block(x, ctx, layer_cache)
        if cache is not None:
            cache.positions = k_positions
        return self.ln_f(x)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, cache: bool = True, generator: torch.Generator | None = None) -> Tensor:
        """Continue ``idx`` (B, P) by ``max_new_tokens`` tokens; temperature 0 = greedy.

        ``cache=True`` decodes one token per step against cached keys and values;
        ``cache=False`` recomputes the whole sequence each step (for comparison). Both see the
        positions 0..P+max_new_tokens-1 as one span, so they agree with each other and with
        one full forward over the final sequence. Dynamic NTK therefore takes its scale from
        the final length from the first step on (instead of re-scaling as the text grows,
        which would leave cached keys rotated at an older scale).
        """
        total = idx.shape[1] + max_new_tokens
        limit = self.pe.max_positions
        if limit is not None and total > limit:
            raise ValueError(f"generating to {total} tokens exceeds the {limit} positions of pe={self.pe.name}; "
                             f"ask for at most {limit - idx.shape[1]} new tokens")
        span = torch.arange(total, device=idx.device)
        kv = KVCache(len(self.blocks), span) if cache else None
        new = idx
        for step in range(max_new_tokens):
            if kv is not None:
                h = self.hidden(new, cache=kv)
            else:  # full recomputation, with the same span for span-dependent schemes
                h = self.hidden(idx, span=span)
            new = sample_next(self.logits(h[:, -1]), temperature, top_k, top_p, generator)
            idx = torch.cat((idx, new), dim=1)
        return idx

    def logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(h)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # padded rows never win a softmax
        return logits

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, positions: Tensor | None = None
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) token ids; positions (T,) or (B, T) integer positions, default 0..T-1.

        Returns logits (B, T, V) and, with targets, the mean cross-entropy (ignore_index -1).
        With targets and a large vocabulary (``use_chunked_loss``: gpt2's 50257) the LM head
        and the loss run in row chunks that never build the (B, T, V) logits, and the logits
        returned are None.
        """
        h = self.hidden(idx, positions)
        if targets is not None and use_chunked_loss(self.config.vocab_size):
            return None, chunked_cross_entropy(h, self.lm_head.weight, targets, vocab_size=self.config.vocab_size)
        logits = self.logits(h)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def token_nll(
        self, idx: Tensor, targets: Tensor, positions: Tensor | None = None, q_chunk: int | None = None
    ) -> Tensor:
        """Per-token negative log-likelihood (B, T) in float32, with the LM head applied in
        chunks so that (B, T, V) logits never exist at once."""
        h = self.hidden(idx, positions, q_chunk)
        step = q_chunk or h.shape[1]
        parts = [
            F.cross_entropy(self.logits(h[:, s : s + step]).float().transpose(1, 2), targets[:, s : s + step],
                            reduction="none")
            for s in range(0, h.shape[1], step)
        ]
        return torch.cat(parts, dim=1)

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.lm_head.weight.dtype
