"""The bench's independent reference: a nanoGPT-style GPT and optimizer, sharing no code with pelab.

Token + learned absolute position embeddings, pre-LayerNorm blocks with causal SDPA, a GELU
MLP, a tied LM head, full logits + ``F.cross_entropy``; AdamW with decay on matrices only and
linear warmup + cosine decay through a ``LambdaLR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ReferenceConfig:
    vocab_size: int  # padded
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = False

    @classmethod
    def from_model(cls, model: dict) -> ReferenceConfig:
        """From a conf/model dict (with ``vocab_size`` and ``pad_vocab_multiple``)."""
        m = model.get("pad_vocab_multiple", 1)
        return cls(vocab_size=(model["vocab_size"] + m - 1) // m * m, block_size=model["block_size"],
                   n_layer=model["n_layer"], n_head=model["n_head"], n_embd=model["n_embd"],
                   dropout=model.get("dropout", 0.0), bias=model.get("bias", False))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        # registration order (ln_2 before attn) fixes the order of the initialisation below
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ReferenceGPT(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        # GPT-2's scaled init of the residual projections. ln_2.weight is drawn here too: the
        # reference's weights have always been made so, and the timed work does not depend on it
        for name, w in self.named_parameters():
            if name.endswith(("ln_2.weight", "c_proj.weight")):
                nn.init.normal_(w, 0.0, 0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def configure_optimizer(net: nn.Module, optim: dict, device: str, total_steps: int):
    """AdamW (decay on matrices only; fused on CUDA only, as nanoGPT) and a warmup + cosine
    ``LambdaLR`` to ``optim['min_lr']`` at ``total_steps``."""
    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"],
                            fused=device == "cuda")
    lr, min_lr, warm = optim["lr"], optim["min_lr"], optim["warmup_steps"]

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return (min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)) / lr

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def flops_per_token(net: nn.Module, config: ReferenceConfig) -> int:
    """``LitGPT.flops_per_token``'s formula (PaLM appendix B): 6N + 12·L·d·T."""
    n = sum(p.numel() for p in net.parameters())
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size
