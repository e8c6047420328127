"""A nanoGPT-style decoder whose position information comes from a pluggable scheme.

The scheme (model/pe/) is asked for its hooks and the attention backend (model/attention/)
adds its terms; nothing here branches on either's name.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import AttentionRequest, Terms, attend, resolve
from model.config import GPTConfig
from model.differential import build as attention_kind, check_scheme
from model.generate import KVCache, LayerCache, generate
from model.loss import chunked_cross_entropy, use_chunked_loss
from model.output_ops import OUTPUTS
from model.pe.base import PositionEncoding
from model.pe.schedule import LayerRope, check_layer_rope, check_nope_layers
from model.positions import Pass, PositionContext, layer_contexts, resolve_positions
from model.temperature import check_temperature, head_scales, query_scales, scale_queries


RMS_EPS = 1e-6  # Llama 2, Qwen 3 and OLMo 2's rms_norm_eps


def swiglu_hidden(n_embd: int) -> int:
    """Llama's SwiGLU width: 8d/3 keeps the GELU MLP's 8d^2 weights, rounded up to a multiple of 64."""
    return -(-(8 * n_embd // 3) // 64) * 64


def norm_layer(config: GPTConfig, dim: int) -> nn.Module:
    """The block's normalisation: GPT-2's LayerNorm (a bias with model.bias) or RMSNorm (never a bias)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=RMS_EPS)
    return nn.LayerNorm(dim, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        self.q_heads = config.query_heads  # n_head, or 2 n_head (differential attention: model/differential.py)
        self.q_dim, self.kv_dim = self.q_heads * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, self.q_dim + 2 * self.kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # per head over the head dim, before the rotation (Qwen 3): bounds q.k's scale, leaves the angles
        self.q_norm = nn.RMSNorm(self.head_dim, eps=RMS_EPS) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=RMS_EPS) if config.qk_norm else None
        self.ssmax = head_scales(config, layer)  # model.attn_temperature=ssmax: this layer's learned s_h, else None
        if config.sink == "learned":  # normaliser sink_learned: one logit per query head joined to its denominator
            self.sinks = nn.Parameter(torch.zeros(self.q_heads))
        elif config.sink == "zero":  # sink_zero, the off-by-one softmax: a constant, not a weight
            self.register_buffer("sinks", torch.zeros(self.q_heads), persistent=False)
        else:
            self.sinks = None
        self.pairs = attention_kind(config)  # differential attention's combination of query-head pairs, or None
        # this layer's operations on each head's output (model/output_ops/: XSA, the output gate), in order
        self.output_ops = nn.ModuleList(op for op in (kind.build(config, layer) for kind in OUTPUTS) if op is not None)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.layer = layer  # its index in the model: a data-dependent scheme's gates are per layer

    def init_layer(self, layer: int) -> None:
        """The inits that follow GPT-2's: torchtitan's gpt-oss init of the learned sinks (truncated
        normal, std 0.02 / sqrt(2 (layer + 1))) and the output operations' own."""
        if isinstance(self.sinks, nn.Parameter):
            nn.init.trunc_normal_(self.sinks, std=0.02 / math.sqrt(2 * (layer + 1)))
        for op in self.output_ops:
            op.init_weights(layer)

    def qkv(self, x: Tensor, ctx: PositionContext) -> tuple[Tensor, Tensor, Tensor]:
        """Heads-first q (B, q_heads, T, hd) and k, v (B, n_kv_head, T, hd), normalised (qk_norm) and
        with the scheme's rotation applied."""
        B, T, C = x.shape
        # split + transpose views: their backward is one cat into c_attn's gradient (a permute's is a stack + copy)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split((self.q_dim, self.kv_dim, self.kv_dim), dim=2))
        if self.q_norm is not None:  # in float32 (HF's RMSNorm), back in the compute dtype v has
            q, k = self.q_norm(q.float()).to(q.dtype), self.k_norm(k.float()).to(k.dtype)
        if ctx.tables is not None:
            q, k = ctx.pe.apply_rotation(q, k, ctx.tables)
        if ctx.q_scale is not None:  # attention temperature, before any backend (model/temperature.py)
            q = scale_queries(q, ctx.q_scale, self.ssmax)  # in float32, then cast (HF Llama 4's order)
        return q, k, v

    def forward(self, x: Tensor, ctx: PositionContext, cache: LayerCache | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x, ctx)
        turned = ctx.terms.with_layer_rotation  # angles c of x turn q, k (v) (model/pe/rope_dd.py)
        c = self.layer_terms(x, ctx, cache)
        if turned:
            q, k, v = ctx.pe.rotate_layer(q, k, v, c)
        key_c = c
        if cache is not None:  # the cache keeps only the n_kv_head heads, and the keys' c (model/cache.py)
            k, v, key_c = cache.append(k, v, c)
            keys = ctx.terms.k_positions.shape[-1]  # a windowed layer attends its window's keys only
            k, v = k[:, :, -keys:], v[:, :, -keys:]
        layer_terms = None if c is None or turned else (c, key_c[..., -ctx.terms.k_positions.shape[-1]:])
        if self.n_kv_head != self.q_heads:  # query head h reads key/value head h // group (HF's repeat_kv)
            group = self.q_heads // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        score_terms = partial(ctx.pe.score_terms, layer=self.layer) if ctx.terms.with_score_terms else None
        y = attend(q, k, v, ctx, self.dropout if self.training else 0.0, self.sinks, layer_terms, score_terms)
        own_v = v[:, :, -T:]  # the new tokens' own values are the last T
        if self.pairs is not None:  # 2H query heads' outputs -> H heads, each with its pair's values
            y, own_v = self.pairs(y, x), self.pairs.head_values(own_v)
        if turned:  # output and own values turned back where the scheme turned the values
            y, own_v = ctx.pe.unrotate_output(y, c), (ctx.pe.unrotate_output(own_v, c) if self.output_ops else own_v)
        for op in self.output_ops:
            y = op(y, x, own_v)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def layer_terms(self, x: Tensor, ctx: PositionContext, cache: LayerCache | None) -> Tensor | None:
        """A data-dependent scheme's c of these tokens (model/pe/fox.py; its angles: model/pe/rope_dd.py),
        or None; with a cache, c continues the newest cached key's (the cache keeps and evicts the
        keys' c with the keys)."""
        if not (ctx.terms.with_layer_terms or ctx.terms.with_layer_rotation):
            return None
        return ctx.pe.layer_terms(x, self.layer, None if cache is None else cache.last_terms())


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gated = config.mlp == "swiglu"
        hidden = swiglu_hidden(config.n_embd) if self.gated else 4 * config.n_embd
        # SwiGLU's gate and up projections are one matmul: c_fc's rows are [W1; W3]
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden if self.gated else hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        if self.gated:  # SwiGLU: W2(silu(W1 x) * W3 x)
            gate, up = h.chunk(2, dim=-1)
            return self.dropout(self.c_proj(F.silu(gate) * up))
        return self.dropout(self.c_proj(self.gelu(h)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = norm_layer(config, config.n_embd)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = norm_layer(config, config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, ctx: PositionContext, cache: LayerCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), ctx, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, pe: PositionEncoding, nope_layers: frozenset[int] = frozenset(),
                 layer_rope: tuple[LayerRope | None, ...] = ()) -> None:
        super().__init__()
        self.config = config
        self.nope_layers = frozenset(nope_layers)  # layers that attend with no position information
        # layer i's own RoPE (pe.global_base, global_keep_fraction, scaling_layers); None or absent: the scheme's
        self.layer_rope = tuple(layer_rope)
        check_nope_layers(self.nope_layers, config.n_layer, pe)
        check_layer_rope(self.layer_rope, pe)
        check_temperature(config, pe, self.nope_layers)
        check_scheme(config, pe)
        self.pe = pe  # shared by all layers; its tables are computed once per forward
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = norm_layer(config, config.n_embd)
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
        for layer, block in enumerate(self.blocks):  # last: the other weights are those of a model without them
            block.attn.init_layer(layer)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        x = self.wte(idx)
        if self.pe.uses_embed:
            x = self.pe.embed(x, positions)
        return self.drop(x)

    def hidden(self, idx: Tensor, positions: Tensor | None = None, documents: Tensor | None = None, *,
               cache: KVCache | None = None, how: Pass = Pass()) -> Tensor:
        """Final normalised hidden states (B, T, C) of tokens ``idx`` at ``positions``; ``documents``:
        (B, T) ids of packed documents (data/packing.py), attention stays inside each (no cache).
        With ``cache`` the tokens continue the cached ones (positions default to the next ones)
        and their keys and values are appended to it. ``how``: generation's and evaluation's knobs."""
        T = idx.shape[1]
        if documents is not None and (cache is not None or documents.shape != idx.shape):
            raise ValueError(f"documents must be (batch, T) = {tuple(idx.shape)} document ids, without a KV cache; "
                             f"got {tuple(documents.shape)}{' with a cache' if cache is not None else ''}")
        past = 0 if cache is None else cache.length
        positions = resolve_positions(self.pe, T, positions, idx.device, start=past)
        k_positions = positions if cache is None else torch.cat((cache.positions, positions), dim=-1)
        if cache is not None:  # decoding: the cache's span, and no query chunks
            how = replace(how, q_chunk=None, span=cache.span if how.span is None else how.span)
        dtype = self._compute_dtype(idx.device)
        x = self.embed(idx, positions)
        backend = self.attention(idx.device, how.attention, dtype, queries=T, batch=idx.shape[0],
                                 documents=documents is not None)
        terms = Terms(self.pe, positions, k_positions, dtype=dtype,
                      explicit_mask=past > 0 and T > 1,  # several new tokens after a cache
                      q_documents=documents, k_documents=documents, normaliser=self.config.normaliser)
        contexts = layer_contexts(terms, backend, how, len(self.blocks), self.nope_layers,
                                  query_scales(self.config, self.pe, positions, past, documents),
                                  self.config.layer_windows, self.layer_rope, self.config.temperature_layers)
        layer_caches = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, ctx, layer_cache in zip(self.blocks, contexts, layer_caches):
            x = block(x, ctx, layer_cache)
        if cache is not None:
            cache.positions = k_positions
        return self.ln_f(x)

    def logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(h)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # padded rows never win a softmax
        return logits

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, positions: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx (B, T) token ids; positions (T,) or (B, T) integer positions, default 0..T-1;
        documents (B, T) document ids (packed documents: attention stays inside each), or None.

        Returns logits (B, T, V) and, with targets, the mean cross-entropy (ignore_index -1).
        With targets and a large vocabulary (``use_chunked_loss``: gpt2's 50257) the LM head
        and the loss run in row chunks that never build the (B, T, V) logits, and the logits
        returned are None.
        """
        h = self.hidden(idx, positions, documents)
        if targets is not None and use_chunked_loss(self.config.vocab_size, h):
            return None, chunked_cross_entropy(h, self.lm_head.weight, targets, vocab_size=self.config.vocab_size)
        logits = self.logits(h)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def token_nll(
        self, idx: Tensor, targets: Tensor, positions: Tensor | None = None, q_chunk: int | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """Per-token negative log-likelihood (B, T) in float32, with the LM head applied in
        chunks so that (B, T, V) logits never exist at once."""
        h = self.hidden(idx, positions, documents, how=Pass(q_chunk=q_chunk))
        step = q_chunk or h.shape[1]
        parts = [
            F.cross_entropy(self.logits(h[:, s : s + step]).float().transpose(1, 2), targets[:, s : s + step],
                            reduction="none")
            for s in range(0, h.shape[1], step)
        ]
        return torch.cat(parts, dim=1)

    generate = generate  # model/generate.py: KV-cache decoding with top-k / top-p sampling

    def attention(self, device: torch.device, name: str | None = None, dtype: torch.dtype = torch.float32,
                  queries: int | None = None, batch: int | None = None, documents: bool = False):
        """The attention backend of a forward now: ``name`` or ``model.attention`` resolved for this
        forward's request (model/attention/__init__.py)."""
        return resolve(name or self.config.attention, self.request(device, dtype, queries, batch, documents))

    def request(self, device: torch.device, dtype: torch.dtype = torch.float32, queries: int | None = None,
                batch: int | None = None, documents: bool = False) -> AttentionRequest:
        """What decides the attention route of a forward now: the scheme, device, dtype, dropout and
        grad mode, number of queries, batch size, packed documents, normaliser and windows."""
        return AttentionRequest.of_model(self.config, self.pe, device, dtype, self.training, torch.is_grad_enabled(),
                                         queries=queries, batch=batch, documents=documents)

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.lm_head.weight.dtype
