"""What the cuda tests share: the routes to test (collected without a GPU), small models with
sharpened attention, one training step, and the error measures with their stated bounds
(docs/gpu.md, "What each check asserts")."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace

import torch

from model.attention import BACKENDS, AttentionRequest, resolve
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from tests.tiny import tiny_gpt

CUDA = torch.device("cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DROPOUTS = (0.0, 0.2)
# fp16 losses are scaled before backward as GradScaler would (its first scale is 2^16; 2^10 keeps
# these small models' gradients far from both fp16 underflow and overflow)
FP16_LOSS_SCALE = 2.0**10
# the floor of the route-vs-math bound, per compute dtype (relative error): about 2.5 units of
# rounding (2^-8 for bf16, 2^-11 for fp16) on top of twice math's own error against float32
FLOOR = {torch.bfloat16: 1e-2, torch.float16: 1.2e-3}

T, BATCH = 128, 4


def config(attention: str = "auto", dropout: float = 0.0, vocab: int = 96, n_embd: int = 64, n_head: int = 4,
           **options) -> GPTConfig:
    """``options``: other model options (model.sinks, model.window, ...)."""
    return GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=n_head, n_embd=n_embd, dropout=dropout,
                     attention=attention, **options)


def scheme_instance(name: str, cfg: GPTConfig):
    with torch.random.fork_rng(devices=[]):  # at collection: leave the tests' random state alone
        return SCHEMES[name](cfg)


def serves_cuda(backend) -> bool:
    """Whether a backend serves some registered scheme in a CUDA training step (its own refusal)."""
    return any(backend.refusal(AttentionRequest(scheme_instance(name, config()), CUDA, torch.bfloat16, grad=True))
               is None for name in sorted(SCHEMES))


# model.attention values a CUDA run can ask for (bias_grad is a CPU kernel)
CUDA_CHOICES = ("auto", *(n for n, b in BACKENDS.items() if serves_cuda(b)))


def routes() -> list[tuple[str, str, float, str, tuple[str, ...]]]:
    """(scheme, precision, dropout, backend that runs, the model.attention values that lead
    there) for every distinct route of a CUDA training step; resolved for a CUDA device
    without one (resolve only reads the device type)."""
    found: dict[tuple, list[str]] = {}
    for scheme in sorted(SCHEMES):
        pe = scheme_instance(scheme, config())
        for precision, dtype in DTYPES.items():
            for dropout in DROPOUTS:
                for choice in CUDA_CHOICES:
                    if choice == "flex" and dropout:
                        continue  # GPTConfig refuses it (flex has no attention dropout)
                    try:
                        route = resolve(choice, AttentionRequest(pe, CUDA, dtype, dropout, grad=True)).name
                    except ValueError:  # a named backend that refuses the scheme (flex with CoPE): no route
                        continue
                    found.setdefault((scheme, precision, dropout, route), []).append(choice)
    return [(*key, tuple(choices)) for key, choices in found.items()]


def learned_bias_schemes() -> list[str]:
    """Schemes whose attention bias has parameters (T5, KERPLE, FIRE), from the registry."""
    return [name for name in sorted(SCHEMES)
            if (pe := scheme_instance(name, config())).uses_bias and any(True for _ in pe.parameters())]


def build(scheme: str, cfg: GPTConfig, seed: int = 0) -> GPT:
    """A GPT on CUDA whose attention is far from uniform (larger q/k/v weights than GPT-2's
    init), so that a wrong position term or mask changes the outputs."""
    return tiny_gpt(scheme, seed, config=cfg, sharpen=0.25).train().to(CUDA)


def with_attention(model: GPT, attention: str) -> GPT:
    """A copy with the same weights and another model.attention."""
    other = copy.deepcopy(model)
    other.config = replace(model.config, attention=attention)
    return other


def attention_dropout_only(model: GPT) -> GPT:
    """The embedding, residual and MLP dropouts off: only the attention's stays (model.dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def tokens(vocab: int, seed: int = 1, batch: int = BATCH, length: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, length + 1), generator=g).to(CUDA)
    return x[:, :-1], x[:, 1:]


def training_step(model: GPT, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None):
    """(logits, loss, parameter gradients) of one forward + backward in float32 (dtype None) or
    under CUDA autocast; fp16 losses scaled by FP16_LOSS_SCALE, gradients unscaled after."""
    model.train()
    model.zero_grad(set_to_none=True)
    scale = FP16_LOSS_SCALE if dtype == torch.float16 else 1.0
    with torch.autocast(CUDA.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logits, loss = model(x, y)
    (loss * scale).backward()
    grads = [torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.detach().float() / scale
             for p in model.parameters()]
    return logits.detach().float(), loss.detach().float(), grads


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).double() for t in tensors])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (inf where a is not finite)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def scheme_parameter_indices(model: GPT) -> list[int]:
    ids = {id(p) for p in model.pe.parameters()}
    return [i for i, p in enumerate(model.parameters()) if id(p) in ids]


@contextlib.contextmanager
def highest_matmul_precision():
    """float32 matmuls in float32 (no TF32) for references, restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
