"""``flex``: FlexAttention with the scheme's elementwise bias as ``score_mod`` and a causal BlockMask.

Compiled on CUDA (one kernel per shape); eager elsewhere (on CPU, forward only: eager flex
differentiates the tensors score_mod captures, never q, k, v). Float32 throughout the scores, so
position terms keep float32 accuracy. No attention dropout. Query chunks attend the full-length
K/V with the chunk's offset in the BlockMask (fully masked key blocks are skipped), so every
chunk of a length shares one compiled kernel.

Inductor builds flex's backward only for a score_mod that indexes each captured tensor which
requires gradients once (``validate_joint_graph``; tests/model/test_flex_joint_graph.py checks
every scheme on CPU). A scheme whose elementwise form does not (``flex_reads_bias``: FIRE's
unrolled MLP), and on CUDA every bias with parameters (``Flex.reads_table``), gets under
autograd its ``bias()`` computed outside the kernel and read once per score: (H, Tq, Tk)
float32, or (B, H, Tq, Tk) with per-sequence positions, as a float mask.

A data-dependent scheme's c_i - c_j (FoX, ``layer_terms``) joins score_mod from (B, H, T) terms
of the queries and of the keys, four captured tensors: each c's float32 head and remainder
(``split_terms``), the heads' difference and the remainders' added together, as ``pair_terms``
forms it. Each head requires gradients and is indexed once; the remainders are constants, and
so is the queries' c unless the LSE is asked for (a row's constant: only the LSE sees it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

from model.attention.base import AttentionBackend, Terms, split_terms
from model.attention.request import AttentionRequest

# Compiled flex specialises on every (batch, Tq, Tk): an evaluation sweep (lengths x query
# chunks x batch sizes) passes dynamo's default limit of 8, past which flex runs unfused and
# materialises the scores.
FLEX_RECOMPILE_LIMIT = 64
# The forward kernel reading a float32 (H, Tq, Tk) bias (``reads_table``) at head size 64 on an
# H100 asks for 240 KiB of shared memory with Inductor's default 3 stages (the limit is 227 KiB):
# two stages fit (docs/gpu.md, acceptance run).
TABLE_KERNEL_OPTIONS = {"fwd_num_stages": 2}


def in_order(kv_idx, token, window: int | None):
    """mask_mod's test of token order: the key at or before the query's token, and inside its
    sliding window (keys token-W+1..token) when there is one."""
    visible = kv_idx <= token
    return visible if window is None else visible & (kv_idx > token - window)


@dataclass
class FlexState:
    score: Callable | None  # the scheme's f(q_pos, k_pos, head) -> float32 bias, None: causal only
    q_positions: Tensor
    k_positions: Tensor
    offset: int | None = None  # query row i is token offset + i of the keys (None: the last Tq tokens)
    documents: Any = None  # packed documents: this forward's (or chunk's) document BlockMask, else None
    table: Tensor | None = None  # (H, Tq, Tk) or (B, H, Tq, Tk) float32 bias read instead of score, or None
    window: int | None = None  # sliding window: the BlockMask also hides keys before it (and skips their blocks)
    layer: tuple[Tensor, ...] | None = None  # a layer's c: (q_hi, k_hi, q_lo, k_lo), or float64 (q, k)


def with_layer_terms(score_mod: Callable | None, q_hi: Tensor, k_hi: Tensor, q_lo: Tensor | None = None,
                     k_lo: Tensor | None = None) -> Callable:
    """``score_mod`` (None: the plain score) plus c_i - c_j of (B, H, Tq) and (B, H, Tk) terms:
    the heads' difference and, given, the remainders', summed before they meet the score."""
    def mod(s, b, h, q_idx, kv_idx):
        pair = q_hi[b, h, q_idx] - k_hi[b, h, kv_idx]
        if q_lo is not None:
            pair = pair + (q_lo[b, h, q_idx] - k_lo[b, h, kv_idx])
        return (s if score_mod is None else score_mod(s, b, h, q_idx, kv_idx)) + pair

    return mod


class Flex(AttentionBackend):
    name = "flex"
    dropout = False
    strict = True  # model.attention=flex with a scheme it cannot run is an error, not another backend
    decode = "math"  # one decoded token: a compiled kernel per cache length buys nothing
    fallback = ("math",)
    plain = "flex"
    full_keys = True
    compile_devices = ("cuda",)  # where flex_attention runs compiled (CPU flex runs eager)
    compile_backend = "inductor"
    terms = ("layer",)  # c_i - c_j in score_mod (``with_layer_terms``)
    lse = True  # flex_attention's auxiliary LSE

    def __init__(self) -> None:
        self._compiled = None
        self._block_masks: dict = {}  # causal BlockMasks per (Tq, Tk, offset, window, device)

    def refusal(self, request: AttentionRequest) -> str | None:
        pe = request.pe
        if pe.uses_bias and pe.bias_score() is None:
            return f"model.attention={self.name}: pe={pe.name} gives no elementwise bias (bias_score)"
        why = super().refusal(request)
        if why is None and request.grad and request.device.type == "cpu":  # torch's flex_attention has no CPU backward
            why = (f"model.attention={self.name} has no backward on cpu (FlexAttention trains on CUDA only); use "
                   f"model.attention=auto, sdpa or math to train there")
        return why

    def prepare(self, terms: Terms, chunked: bool = False) -> FlexState:
        score = terms.pe.bias_score() if terms.with_bias else None
        if terms.with_bias and score is None:
            raise ValueError(f"model.attention=flex: pe={terms.pe.name} gives no elementwise bias (bias_score)")
        documents = None
        if terms.documents and not chunked:  # built once per forward, shared by every layer
            documents = self.document_mask(terms.k_documents, terms.q_positions.shape[-1], None, terms.window)
        table = None
        if terms.with_bias and torch.is_grad_enabled() and self.reads_table(terms.pe, terms.q_positions.device):
            table = terms.pe.bias(*terms.bias_positions())  # once per forward, shared by every layer
        return FlexState(score, terms.q_positions, terms.k_positions, documents=documents, table=table,
                         window=terms.window)

    @staticmethod
    def reads_table(pe, device: torch.device) -> bool:
        """Under autograd, whether the bias is read as a float32 table computed outside the kernel
        instead of through ``score_mod``: for a scheme whose score_mod Inductor cannot
        differentiate (``flex_reads_bias``), and on CUDA for every bias with parameters. There,
        flex's backward adds each score's gradient into the captured parameter with atomics, every
        thread on the same few entries: at gpt2 size on an H100, t5's training step took 34x and
        kerple_log's 50x rope's (docs/gpu.md). The table's gradient spreads over H*Tq*Tk entries
        and autograd reduces it to the parameters once per forward."""
        if getattr(pe, "flex_reads_bias", False):
            return True
        return device.type == "cuda" and pe.uses_bias and any(p.requires_grad for p in pe.parameters())

    def add_layer_terms(self, state: FlexState, q_terms: Tensor, k_terms: Tensor, dtype: torch.dtype) -> FlexState:
        """The state with a layer's float64 c of its queries and of all Tk keys (``full_keys``):
        as they are for float64 compute, else each as float32 head and remainder (``split_terms``)."""
        if dtype == torch.float64:
            return replace(state, layer=(q_terms, k_terms))
        (q_hi, q_lo), (k_hi, k_lo) = split_terms(q_terms), split_terms(k_terms)
        return replace(state, layer=(q_hi, k_hi, q_lo, k_lo))

    def chunk(self, state: FlexState, terms: Terms, s: int, e: int) -> FlexState:
        """Rows [s, e) against all Tk keys: the BlockMask's offset hides the keys they do not see."""
        offset = terms.k_positions.shape[-1] - terms.q_positions.shape[-1] + s
        documents = None
        if terms.documents:
            documents = self.document_mask(terms.k_documents, e - s, offset, terms.window)
        table = None if state.table is None else state.table[..., s:e, :]
        return FlexState(state.score, terms.q_positions[..., s:e], terms.k_positions, offset, documents, table,
                         terms.window)

    @staticmethod
    def document_mask(documents: Tensor, Tq: int, offset: int | None, window: int | None = None):
        """The BlockMask of packed documents: Tq queries (tokens offset.., by default the last
        Tq) against the (B, Tk) document ids of the keys, causal and inside the query's
        document (and its ``window``). Blocks with no pair of one document are skipped, so
        attention gets cheaper as documents get shorter. The queries' ids are read from the
        keys' (one captured tensor: flex's compiled wrapper guards captured tensors against
        aliasing)."""
        from torch.nn.attention.flex_attention import create_block_mask

        B, Tk = documents.shape
        shift = torch.tensor(Tk - Tq if offset is None else offset, device=documents.device)

        def same_document(b, h, q_idx, kv_idx):
            token = q_idx + shift
            return in_order(kv_idx, token, window) & (documents[b, token] == documents[b, kv_idx])

        if torch.compiler.is_compiling():
            return create_block_mask(same_document, B, None, Tq, Tk, device=documents.device)
        with torch.inference_mode(False):  # as the causal masks: a later backward may save it
            return create_block_mask(same_document, B, None, Tq, Tk, device=documents.device)

    def block_mask(self, Tq: int, Tk: int, device: torch.device, offset: int | None = None,
                   window: int | None = None):
        """The causal BlockMask of Tq queries (tokens offset..offset+Tq-1, by default the last Tq)
        against Tk keys, with a sliding ``window`` (query t sees keys t-W+1..t; blocks wholly
        before it are skipped), built once per (shape, offset, window) in eager mode; a compiled
        graph builds its own (a cache mutated inside the graph would recompile it)."""
        from torch.nn.attention.flex_attention import create_block_mask

        offset = Tk - Tq if offset is None else offset

        def build():
            # the offset as a tensor, not a constant: masks at other offsets share one compiled kernel
            shift = torch.tensor(offset, device=device)

            return create_block_mask(lambda b, h, q_idx, kv_idx: in_order(kv_idx, q_idx + shift, window), None, None,
                                     Tq, Tk, device=device)

        if torch.compiler.is_compiling():
            return build()
        key = (Tq, Tk, offset, window, str(device))
        if key not in self._block_masks:
            # normal tensors even when first asked for under inference_mode (Lightning's sanity
            # validation): inference tensors in the cache could not be saved for a later backward
            with torch.inference_mode(False):
                self._block_masks[key] = build()
        return self._block_masks[key]

    def compiled(self, q: Tensor, k: Tensor, v: Tensor, score_mod, block_mask, options=None, aux=None):
        """``flex_attention`` compiled once per process, one kernel per shape (the CUDA path)."""
        from torch.nn.attention.flex_attention import flex_attention

        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=False, backend=self.compile_backend)
        with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
            return self._compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options,
                                  return_aux=aux)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float, lse: bool = False):
        """flex_attention's output; with ``lse`` (out, each row's log-sum-exp)."""
        out = self.attend(q, k, v, state, lse)
        return (out[0], out[1].lse) if lse else out

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: Any, lse: bool):
        """flex_attention's output, and its auxiliary outputs (the LSE) with ``lse``."""
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        B, Tq, Tk = q.shape[0], q.shape[2], k.shape[2]
        score_mod = None
        if state.table is not None and state.table.dim() == 3:  # one bias for the batch
            table = state.table

            def score_mod(s, b, h, q_idx, kv_idx):
                return s + table[h, q_idx, kv_idx]
        elif state.table is not None:  # per-sequence positions
            table = state.table

            def score_mod(s, b, h, q_idx, kv_idx):
                return s + table[b, h, q_idx, kv_idx]
        elif state.score is not None:
            score = state.score
            qp = (state.q_positions if state.q_positions.dim() == 2 else state.q_positions[None]).expand(B, -1)
            kp = (state.k_positions if state.k_positions.dim() == 2 else state.k_positions[None]).expand(B, -1)

            def score_mod(s, b, h, q_idx, kv_idx):
                return s + score(qp[b, q_idx], kp[b, kv_idx], h)
        if state.layer is not None:
            q_terms, *rest = state.layer
            # c_i shifts query i's whole row, which the softmax ignores and only the LSE sees: else its
            # gradient is zero, and flex's backward would add it into q_terms score by score (atomics)
            score_mod = with_layer_terms(score_mod, q_terms if lse else q_terms.detach(), *rest)

        block_mask = (self.block_mask(Tq, Tk, q.device, state.offset, state.window) if state.documents is None
                      else state.documents)
        dtype = v.dtype
        options = TABLE_KERNEL_OPTIONS if state.table is not None and v.is_cuda else None
        aux = AuxRequest(lse=True) if lse else None
        with torch.autocast(v.device.type, enabled=False):
            if torch.compiler.is_compiling():  # inside the model's graph: traced, no warnings filter (a break)
                return flex_attention(q.to(dtype), k.to(dtype), v, score_mod=score_mod, block_mask=block_mask,
                                      kernel_options=options, return_aux=aux)
            if v.device.type in self.compile_devices:
                return self.compiled(q.to(dtype), k.to(dtype), v, score_mod, block_mask, options, aux)
            with warnings.catch_warnings():  # eager flex warns that it is not the fused kernel
                warnings.simplefilter("ignore")
                return flex_attention(q.to(dtype), k.to(dtype), v, score_mod=score_mod, block_mask=block_mask,
                                      return_aux=aux)
