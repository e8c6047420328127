"""A nanoGPT-style decoder whose position information comes from a pluggable scheme.

The scheme (model/pe/) is asked for its hooks; nothing here branches on its name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
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


class QueryChunks:
    """Evaluate attention in query chunks of ``size``; ``mask`` builds each chunk's float mask."""

    def __init__(self, size: int, mask) -> None:
        self.size, self.mask = size, mask

    def bounds(self, T: int):
        return ((s, min(T, s + self.size)) for s in range(0, T, self.size))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def qkv(self, x: Tensor, pe: PositionEncoding, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Heads-first (B, H, T, hd) q, k, v with the scheme's rotation applied."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if pe.uses_rotate:
            q, k = pe.rotate(q, k, positions, positions)
        return q, k, v

    def forward(
        self, x: Tensor, pe: PositionEncoding, positions: Tensor, attn_mask: Tensor | None, chunk: QueryChunks | None = None
    ) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x, pe, positions)
        dropout = self.dropout if self.training else 0.0
        if chunk is None:
            # A float mask (bias + causal -inf) keeps SDPA on its fused kernels; no mask -> is_causal.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=attn_mask is None)
        else:
            # Long evaluation: query chunk [s, e) attends to keys [0, e) with a mask of only
            # (heads, e - s, e), never the whole (heads, T, T).
            parts = []
            for s, e in chunk.bounds(T):
                mask = chunk.mask(positions[s:e], positions[:e])
                parts.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=mask))
            y = torch.cat(parts, dim=2)
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

    def forward(
        self, x: Tensor, pe: PositionEncoding, positions: Tensor, attn_mask: Tensor | None, chunk: QueryChunks | None = None
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), pe, positions, attn_mask, chunk)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, pe: PositionEncoding) -> None:
        super().__init__()
        self.config = config
        self.pe = pe  # shared by all layers; its tables are computed once per forward where possible
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
        self, q_positions: Tensor, k_positions: Tensor, dtype: torch.dtype, always: bool = False
    ) -> Tensor | None:
        """Float mask (1, H, Tq, Tk): the scheme's bias plus -inf on keys after the query.

        The Tq queries are the last Tq of the Tk tokens (a query chunk, or new tokens after
        a cache). None when the scheme has no bias (SDPA's is_causal is faster), unless
        ``always``.
        """
        future = causal_future(len(q_positions), len(k_positions), q_positions.device)
        if self.pe.uses_bias:
            bias = self.pe.bias(q_positions, k_positions)
        elif always:
            bias = torch.zeros(future.shape, device=future.device).expand(self.config.n_head, -1, -1)
        else:
            return None
        return bias.masked_fill(future, float("-inf")).to(dtype).unsqueeze(0)

    def positions_for(self, T: int, positions: Tensor | None, device: torch.device) -> Tensor:
        """The default 0..T-1, checked against the scheme's table; or validated explicit ones."""
        if positions is None:
            limit = self.pe.max_positions
            if limit is not None and T > limit:
                raise ValueError(
                    f"sequence length {T} exceeds the {limit} positions of pe={self.pe.name}; "
                    f"this scheme cannot run past its table"
                )
            return torch.arange(T, device=device)
        if positions.shape != (T,):
            raise ValueError(f"positions must have shape ({T},), got {tuple(positions.shape)}")
        return positions

    def embed(self, idx: Tensor, positions: Tensor) -> Tensor:
        x = self.wte(idx)
        if self.pe.uses_embed:
            x = self.pe.embed(x, positions)
        return self.drop(x)

    def hidden(self, idx: Tensor, positions: Tensor | None = None, q_chunk: int | None = None) -> Tensor:
        """Final normalised hidden states (B, T, C). ``q_chunk`` bounds attention memory for
        long evaluation sequences (see QueryChunks); training leaves it None."""
        T = idx.shape[1]
        positions = self.positions_for(T, positions, idx.device)
        dtype = self._compute_dtype(idx.device)
        x = self.embed(idx, positions)
        chunk, attn_mask = None, None
        if q_chunk is not None and T > q_chunk:
            chunk = QueryChunks(q_chunk, lambda qp, kp: self.attention_mask(qp, kp, dtype, always=True))
        else:
            attn_mask = self.attention_mask(positions, positions, dtype)
        for block in self.blocks:
            x = block(x, self.pe, positions, attn_mask, chunk)
        return self.ln_f(x)

    def logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(h)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]  # padded rows never win a softmax
        return logits

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """idx (B, T) token ids; positions (T,) integer positions, default 0..T-1.

        Returns logits (B, T, V) and, with targets, the mean cross-entropy (ignore_index -1).
        """
        logits = self.logits(self.hidden(idx, positions))
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
