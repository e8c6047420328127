"""FoX, the Forgetting Transformer (Lin et al., ICLR 2025): a data-dependent ALiBi.

Each layer l and head h has a forget gate of the layer's input x_t (the normed block input the
attention sees), f_t = sigmoid(w_lh . x_t + b_lh), and the logit of query i and key j gains the
log of the gates between them:

    logit_ij += sum_{t=j+1..i} log f_t = c_i - c_j,    c_t = sum_{s<=t} log f_s.

The decay runs over tokens, never over position values: FoX has no embed, rotate or bias hook,
and enters attention through the data-dependent hook (``layer_terms``), which the backends that
declare ``layer_terms`` add to their float32 scores: math's and sdpa's float32 mask
(model/attention/base.py), flex's score_mod (model/attention/flex.py).

Transcribed from the authors' code (zhixuan-lin/forgetting-transformer,
src/forgetting_transformer/model/forgetting_transformer/modeling_forgetting_transformer.py,
``fgate_type="full"``; ops/forgetting_attention.py): the gate is ``nn.Linear(hidden, heads,
bias=True)`` with the model's normal(0, 0.02) weight and zero bias (f = 1/2 at init), and
log f = logsigmoid(logit.float()). Where the code differs: its cumsum is float32; here it is
float64 and c_i - c_j is formed from each c's float32 head and remainder (model/attention/base.py,
``split_terms``: in ``pair_terms`` and flex's score_mod alike), so it keeps float32's relative
accuracy however long the sequence (float32 c errs by eps |c_i|, growing with T).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding

GATE_STD = 0.02  # the authors' initializer_range for every Linear, the gate's included


class FoX(PositionEncoding, name="fox"):
    terms: ClassVar[str | None] = "layer"

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.gates = nn.ModuleList(nn.Linear(config.n_embd, config.n_head, bias=True) for _ in range(config.n_layer))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=GATE_STD)
            nn.init.zeros_(gate.bias)

    def layer_terms(self, x: Tensor, layer: int, start: Tensor | None = None) -> Tensor:
        """c (B, H, T) float64 of layer ``layer``'s input x (B, T, C): the cumulative log forget
        gates, continuing ``start`` (B, H, 1), the c of the token before x (a KV cache), if given."""
        if not 0 <= layer < len(self.gates):
            raise ValueError(f"pe=fox has gates for layers 0..{len(self.gates) - 1}, got layer {layer}")
        with torch.autocast(x.device.type, enabled=False):
            gate = self.gates[layer]
            logit = gate(x.to(gate.weight.dtype)).to(torch.promote_types(gate.weight.dtype, torch.float32))
        c = torch.cumsum(F.logsigmoid(logit).transpose(1, 2).double(), dim=-1)
        return c if start is None else c + start

    def decayed_parameters(self) -> list[nn.Parameter]:
        return [gate.weight for gate in self.gates]  # the authors decay every Linear weight, biases not

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        biases = torch.stack([gate.bias.float().cpu() for gate in self.gates])  # (layers, H)
        return {"gate bias b_h by layer": (torch.arange(len(self.gates)).float(), biases.t(), "layer")}

