"""The attention-backend interface and the position inputs every backend prepares from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from model.attention.masks import attention_mask, causal_future, hidden_keys
from model.attention.normalisers import NORMALISERS
from model.attention.request import AttentionRequest


def follow_order(positions: Tensor, documents: Tensor) -> bool:
    """Whether (B, T) positions step by one inside every run of equal (B, T) document ids, and
    every id is one run (ids never decrease): then p_i - p_j = i - j for every pair of one
    document. Read on the host; a compiled graph reads nothing and answers False (the given
    positions, always right)."""
    if torch.compiler.is_compiling():
        return False
    same = documents[:, 1:] == documents[:, :-1]
    steps = positions.diff(dim=-1) == 1
    return bool(((steps | ~same) & (documents[:, 1:] >= documents[:, :-1])).all())


def data_terms(pe: Any) -> str | None:
    """What a data-dependent scheme adds (``PositionEncoding.terms``): "layer" (c_i - c_j of each
    layer's input, FoX), "scores" (a term of each layer's queries and scores, CoPE), "rotation"
    (angles of each layer's input turning q, k and v before any backend, rope_dd), or None."""
    return getattr(pe, "terms", None)


@dataclass(frozen=True)
class Terms:
    """The position inputs of one forward. The Tq queries are the last Tq of the Tk keys (a
    query chunk, or new tokens after a KV cache); causality follows token order."""

    pe: Any  # the scheme (model/pe/); only its hooks are called
    q_positions: Tensor  # (Tq,) or (B, Tq)
    k_positions: Tensor  # (Tk,) or (B, Tk)
    bias: bool = True  # add the scheme's bias (False: a NoPE layer of a schedule, causal only)
    dtype: torch.dtype = torch.float32  # the compute dtype of q, k, v
    explicit_mask: bool = False  # an explicit causal mask even without a bias
    q_documents: Tensor | None = None  # (B, Tq) document ids (packed documents); None: one document
    k_documents: Tensor | None = None  # (B, Tk)
    window: int | None = None  # sliding window W, query i sees keys i-W+1..i; None (or W >= Tk): all earlier keys
    normaliser: str = "softmax"  # model.normaliser, which ``attend`` applies (normalisers.py)

    @property
    def with_bias(self) -> bool:
        return self.bias and self.pe.uses_bias

    @property
    def with_layer_terms(self) -> bool:
        """Each layer adds the scheme's data-dependent terms c_i - c_j (``pe.layer_terms``) to its mask."""
        return self.bias and data_terms(self.pe) == "layer"

    @property
    def with_layer_rotation(self) -> bool:
        """Each layer turns q, k (and v) by the scheme's angles of its input (``pe.rotate_layer``)."""
        return self.bias and data_terms(self.pe) == "rotation"

    @property
    def with_score_terms(self) -> bool:
        """Each layer adds the scheme's terms of its queries and scores (``pe.score_terms``) to its logits."""
        return self.bias and data_terms(self.pe) == "scores"

    def key_span(self, s: int, e: int) -> tuple[int, int]:
        """The keys [ks, ke) that query rows [s, e) see: up to the last row's token, from the
        first row's window on (all earlier keys without a window)."""
        Tq, Tk = self.q_positions.shape[-1], self.k_positions.shape[-1]
        return (0 if self.window is None else max(0, Tk - Tq + s - self.window + 1)), Tk - Tq + e

    def rows(self, s: int, e: int) -> Terms:
        """Query rows [s, e) against the keys they see (a query chunk): O(rows x W) with a window."""
        return self.keys(*self.key_span(s, e), s, e, explicit_mask=True)

    def keys(self, ks: int, ke: int, s: int = 0, e: int | None = None, explicit_mask: bool | None = None) -> Terms:
        """Query rows [s, e) against keys [ks, ke), the rows being the last of those keys; a
        window that hides none of them is dropped (no mask needed for it)."""
        e = self.q_positions.shape[-1] if e is None else e
        window = self.window if self.window is not None and self.window < ke - ks else None
        documents = {} if self.q_documents is None else {"q_documents": self.q_documents[:, s:e],
                                                          "k_documents": self.k_documents[:, ks:ke]}
        return replace(self, q_positions=self.q_positions[..., s:e], k_positions=self.k_positions[..., ks:ke],
                       window=window, explicit_mask=self.explicit_mask if explicit_mask is None else explicit_mask,
                       **documents)

    def windowed(self, window: int | None) -> Terms:
        """These terms for a layer with ``window``: the keys no query sees dropped (a KV cache
        longer than the window), the window kept only where it hides a key."""
        terms = replace(self, window=window)
        return terms.keys(*terms.key_span(0, self.q_positions.shape[-1])) if window is not None else terms

    @property
    def documents(self) -> bool:
        """Packed documents: a token sees only its own document's earlier tokens."""
        return self.q_documents is not None

    def mask(self, always: bool = False) -> Tensor | None:
        """The float32 mask (bias + causal -inf), or None for a plain causal layer."""
        return attention_mask(self.pe, *self.bias_positions(), torch.float32,
                              always=always or self.explicit_mask or self.window is not None, with_bias=self.bias,
                              q_documents=self.q_documents, k_documents=self.k_documents, window=self.window)

    def order_mask(self) -> Tensor | None:
        """SDPA's mask: the float32 one with a bias; else a boolean order mask (Tq, Tk) where
        one is needed (bool is accepted by every SDPA kernel whatever q's dtype), or None.
        Documents without a bias: (B, 1, Tq, Tk) bool, never a float per head."""
        if self.with_bias or self.with_layer_terms:
            return self.mask(always=self.with_layer_terms)
        if self.documents or self.window is not None:
            return ~self.hidden()
        if not self.explicit_mask:
            return None
        return ~causal_future(self.q_positions.shape[-1], self.k_positions.shape[-1], self.q_positions.device)

    def bias_positions(self) -> tuple[Tensor, Tensor]:
        """The positions the bias is computed at: these, or, for a bias of the distance alone under
        a document mask with per-sequence positions that follow token order inside every document
        (restarted or not: p_i - p_j = i - j for every visible pair), token order's: one
        (H, Tq, Tk) bias by strides, not a gather per sequence whose backward scatters (B, Tq, Tk)
        indices. Positions that do not follow token order (randomized positions) are kept: the
        bias is the model's at the given positions on every backend."""
        if not (self.documents and getattr(self.pe, "bias_of_distance", False) and self.k_positions.dim() == 2
                and follow_order(self.k_positions, self.k_documents)):
            return self.q_positions, self.k_positions
        order = torch.arange(self.k_positions.shape[-1], device=self.k_positions.device)
        return order[order.shape[0] - self.q_positions.shape[-1]:], order

    def hidden(self) -> Tensor:
        """(Tq, Tk) or, with documents, (B, 1, Tq, Tk) bool: True where a key is hidden (later,
        before the window, or of another document)."""
        return hidden_keys(self.q_positions.shape[-1], self.k_positions.shape[-1], self.q_positions.device,
                           self.q_documents, self.k_documents, self.window)


def split_terms(terms: Tensor) -> tuple[Tensor, Tensor]:
    """float64 terms c as a float32 head c.float() and the float32 remainder of c - head. The
    remainder is a constant to autograd: its derivative (1 - 1) is zero, so the gradient reaches c
    through the head alone, as it would through c itself."""
    head = terms.float()
    return head, (terms.detach() - head.detach().double()).float()


def pair_terms(q_terms: Tensor, k_terms: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(B, H, Tq, Tk) c_i - c_j of float64 (B, H, Tq) and (B, H, Tk) terms: float64 for float64
    compute, else float32 within about one rounding of the difference, however large c grows
    with T: each c is split into a float32 head and remainder (``split_terms``), subtracted apart
    (flex's score_mod adds the same two differences)."""
    if dtype == torch.float64:
        return q_terms[..., :, None] - k_terms[..., None, :]
    (q_hi, q_lo), (k_hi, k_lo) = split_terms(q_terms), split_terms(k_terms)
    return (q_hi[..., :, None] - k_hi[..., None, :]) + (q_lo[..., :, None] - k_lo[..., None, :])


class AttentionBackend:
    """softmax(q k^T / sqrt(d) + position terms + causal mask) v, one way.

    Per forward, ``prepare`` turns the position inputs into what this backend adds (its
    state, shared by every layer); per layer, ``__call__`` attends. ``refusal`` says what it
    does not serve; ``model.attention.resolve`` falls back to ``fallback`` there."""

    name: ClassVar[str]
    dropout: ClassVar[bool] = True  # applies attention dropout (GPTConfig reads it before any scheme exists)
    terms: ClassVar[tuple[str, ...]] = ()  # the kinds of a scheme's data-dependent terms it adds (pe.terms)
    # materialises the weights: returns (output, weights) and takes ``weights=f(logits)`` (a normaliser's)
    records: ClassVar[bool] = False
    lse: ClassVar[bool] = False  # ``lse=True`` also returns each row's log-sum-exp, differentiably
    fallback: ClassVar[tuple[str, ...]] = ("sdpa", "flex", "math")  # in order, where it refuses
    strict: ClassVar[bool] = False  # True: named, it raises its refusal instead of falling back
    decode: ClassVar[str | None] = None  # the backend that serves a single query (decoding); None: itself
    grad_route: ClassVar[str | None] = None  # the backend that serves it under autograd where that one serves
    plain: ClassVar[str] = "sdpa"  # for layers without the scheme's terms (NoPE layers of a schedule)
    full_keys: ClassVar[bool] = False  # query chunks get all Tk keys (``chunk`` hides the later ones)

    def refusal(self, request: AttentionRequest) -> str | None:
        """Why it does not serve ``request`` (the error a strict backend raises), or None. This
        base answers for dropout, the scheme's terms kind and the normaliser; a backend adds its own."""
        pe, kind = request.pe, request.terms
        if request.dropout and not self.dropout:
            return f"model.attention={self.name} has no attention dropout"
        if kind == "layer" and kind not in self.terms:
            return (f"model.attention={self.name} cannot add pe={pe.name}'s per-layer data-dependent terms; "
                    f"use model.attention=auto, sdpa, flex or math")
        if kind == "scores" and kind not in self.terms:
            return (f"model.attention={self.name} cannot add pe={pe.name}'s terms of the attention scores; "
                    f"use model.attention=auto or math")
        return NORMALISERS[request.normaliser].refusal(self, request.dtype)

    def prepare(self, terms: Terms, chunked: bool = False) -> Any:
        """The per-forward state; ``chunked``: the layers attend in query chunks (see ``chunk``)."""
        return None

    def add_layer_terms(self, state: Tensor, q_terms: Tensor, k_terms: Tensor, dtype: torch.dtype) -> Tensor:
        """A layer's state: the prepared float mask plus c_i - c_j of the (B, H, Tq) and (B, H, Tk)
        float64 terms of a data-dependent scheme (``pair_terms``), for compute ``dtype``."""
        return state + pair_terms(q_terms, k_terms, dtype)

    def chunk(self, state: Any, terms: Terms, s: int, e: int) -> Any:
        """The state of query rows [s, e); by default prepared anew for those rows."""
        return self.prepare(terms.rows(s, e))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float) -> Tensor:
        """Attention with the prepared ``state``."""
        raise NotImplementedError
