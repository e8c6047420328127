"""Host synchronisations and eager memory traffic of the LM-head loss, per route, at any shape.

    python scripts/loss_syncs.py                      # gpt2-124M: B=16 T=1024 C=768 V=50257 (padded 50304)
    python scripts/loss_syncs.py B=32                 # past FULL_LOGITS_MAX_ELEMENTS

Runs on the meta device (no values, no compute, no memory), bf16 operands as under bf16
autocast on an accelerator. A dispatch mode counts the operators that read a device value on
the host (torch's tags ``data_dependent_output`` / ``dynamic_output_shape``, ``bool()`` of a
tensor) and answers them (every target scored and in range, no underflowing softmax), so the
CPU-tuned loop runs too; it enters pelab's opaque custom op. "bytes" sums each non-view
operator's tensor inputs read and outputs written: eager traffic, an upper bound for a compiled graph
(Inductor fuses the ``full`` route's elementwise passes). Results: docs/performance.md §1.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _common  # noqa: F401 - the checkout on sys.path: model/ is not installed
import model.loss as loss_mod

ATEN = torch.ops.aten
HOST_READS = {ATEN.is_nonzero.default, ATEN.equal.default}
METADATA = {ATEN.empty.memory_format, ATEN.empty_like.default, ATEN.detach.default}
SPARSE = {ATEN.gather.default, ATEN.scatter_add_.default, ATEN.scatter_add.default}


class Meter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tags = func.tags
        if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags or func in HOST_READS:
            self.syncs[str(func)] += 1
            if func in HOST_READS:
                return False  # no underflowing softmax[target], no target out of range
            if func in (ATEN.item.default, ATEN._local_scalar_dense.default):
                x = args[0]
                return x.numel() if not x.dtype.is_floating_point else 1.0  # every target scored
        if func is torch.ops.pelab.chunked_linear_cross_entropy.default:
            with self:
                return loss_mod._loss_and_grads_impl(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in SPARSE:  # gather / scatter_add_ touch index-many elements of self, not all of it
            x, index = args[0], args[2]
            touched = index.numel() * x.element_size() * (1 if func is ATEN.gather.default else 2)
            self.bytes += index.nbytes + 2 * touched
        elif not func.is_view and func not in METADATA:  # inputs read (an out= buffer is not), outputs written
            read = [*args, *(v for k, v in kwargs.items() if k != "out")]
            written = out if isinstance(out, (tuple, list)) else (out,)
            self.bytes += sum(x.nbytes for x in (*read, *written) if isinstance(x, torch.Tensor))
        return out


def lm_head(route: str, B: int, T: int, C: int, V: int, Vp: int) -> dict:
    h = torch.empty(B, T, C, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(Vp, C, device="meta", dtype=torch.bfloat16, requires_grad=True)
    t = torch.empty(B, T, dtype=torch.long, device="meta")
    with loss_mod.forced_loss_route(route), Meter() as m:
        if route == "full":  # GPT.forward's two lines
            logits = torch.nn.functional.linear(h, w)[..., :V]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), t.flatten(), ignore_index=-1)
        else:
            loss = loss_mod.chunked_cross_entropy(h, w, t, vocab_size=V)
        loss.backward()
    return {"route": route, "host_syncs": sum(m.syncs.values()), "by_op": dict(m.syncs),
            "eager_GB": round(m.bytes / 1e9, 1)}


def main(argv: list[str]) -> None:
    from _cli import command_line
    from _common import integer

    cfg = command_line("loss_syncs", argv, __doc__)
    if cfg is None:
        return
    opts = {key: integer(key, cfg[key], minimum=1) for key in ("B", "T", "C", "V", "Vp")}
    print(json.dumps(opts))
    for route in loss_mod.LOSS_ROUTES:
        print(json.dumps(lm_head(route, opts["B"], opts["T"], opts["C"], opts["V"], opts["Vp"])))


if __name__ == "__main__":
    main(sys.argv[1:])
