"""The position-encoding interface.

Position information enters attention at exactly three places, one hook each:

1. ``embed(x, positions)``: added to the token embeddings before the first block;
2. ``rotate(q, k, q_positions, k_positions)``: applied to queries and keys;
3. ``bias(q_positions, k_positions)``: additive attention logits, shape (..., heads, Tq, Tk).

A bias scheme may also give its bias in the forms the fused attention backends need (both
optional, both must equal ``bias``): ``bias_score()``, an elementwise function for
FlexAttention's ``score_mod``, and ``key_only_slopes()``, per-head slopes m when the bias is
exactly -m_h (i - j) (ALiBi-type), which the ``sdpa_key`` backend carries inside q.k.

Positions are (T,), or (B, T) when every sequence has its own (packed documents,
randomized positions); hooks keep any leading batch dims.

A scheme overrides the hooks it needs; the model asks ``uses_embed``/``uses_rotate``/
``uses_bias`` and never looks at a scheme's name. Positions are integer tensors so that
KV-cache decoding, sliding windows and packed documents can pass offsets. All position
math happens in float32 and is cast to the compute dtype at the very end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.scaling import check_kind

SCHEMES: dict[str, type["PositionEncoding"]] = {}


class PositionEncoding(nn.Module):
    """Base class: every hook defaults to 'contributes nothing'."""

    name: ClassVar[str] = "none"
    # ``bias`` is a function of p_i - p_j alone: under a document mask, positions that step by one
    # inside every document (restarted at its start or not) give token order's distances, so the
    # backends that build a mask compute one bias at token order's positions for the whole batch
    # (model/attention/base.py, ``Terms.bias_positions``); other positions (randomized) are used
    # as given.
    bias_of_distance: ClassVar[bool] = False
    # The scaling kinds the scheme takes (model/pe/rope_scaling.py), and the one it has now: set by
    # ``scale`` for training, or inside ``scaled`` for an evaluation (model/pe/scaling.py).
    scaling_kinds: ClassVar[tuple[str, ...]] = ()
    scaling: Any = None
    # The kind of data-dependent terms the scheme adds to attention (model/attention/base.py reads it):
    # None (positions alone); "layer": ``layer_terms`` gives each layer's (B, H, T) float64 c of its
    # input and attention adds c_i - c_j (FoX); "scores": ``score_terms`` gives extra logits of each
    # layer's queries and scaled scores (CoPE). Only the backends whose ``terms`` hold the kind add them.
    # "rotation": ``layer_terms`` gives each layer's float64 angles of its input, by which ``rotate_layer``
    # turns q, k (and v) before any backend, adding nothing to attention (model/pe/rope_dd.py).
    terms: ClassVar[str | None] = None
    # The rotation differs per head (PoPE's learned phase per head and component): it is sized for the
    # n_head query heads, so differential attention's 2 n_head refuse it (model/differential.py).
    head_rotation: ClassVar[bool] = False

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in SCHEMES:  # a second class under one name would silently replace the first
                raise ValueError(f"position scheme {name!r} is already registered by "
                                 f"{SCHEMES[name].__module__}.{SCHEMES[name].__qualname__}")
            cls.name = name
            SCHEMES[name] = cls

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_embd = config.n_embd

    @property
    def max_positions(self) -> int | None:
        """Largest number of distinct positions the scheme can encode (None: unbounded)."""
        return None

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def rotate(self, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        return None

    def bias_score(self) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
        """The bias as an elementwise function ``f(q_pos, k_pos, head) -> float32`` of
        broadcastable integer tensors (0-dim inside FlexAttention's ``score_mod``), equal to
        ``bias(q_positions, k_positions)[..., head, i, j]``. Called once per forward, so any
        per-forward preparation (a parameter projection) happens here, outside the kernel.
        None: no bias, or no elementwise form (the flex backend then refuses the scheme)."""
        return None

    def key_only_slopes(self) -> Tensor | None:
        """Per-head slopes m (H,) float32 when ``bias`` is exactly -m_h (i - j), else None.

        Under a causal softmax the row-constant part -m_h i drops out, leaving +m_h j: a term
        of the key alone, which the ``sdpa_key`` attention path appends to k (with constant
        features on q) so that SDPA's causal kernel computes it inside q.k."""
        return None

    def scale(self, scaling: Any) -> None:
        """Scale positions from now on by ``scaling`` (a RopeScaling of a kind in ``scaling_kinds``).
        A scheme that takes one extends this (``super().scale`` first), changing only its
        attributes and buffers, which ``scaled`` restores after an evaluation."""
        check_kind(self, scaling.kind, "pe.scaling.kind")
        if self.scaling is not None:
            raise ValueError(f"pe={self.name} is already scaled by {self.scaling}")
        self.scaling = scaling

    def resized_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The scheme's saved tensors (``init_from``, keys relative to the scheme) made to fit
        this instance (a learned table of another length); default: as they are."""
        return state

    def project(self) -> None:
        """Bring constrained parameters back into their range; called after every optimizer
        step (never inside forward: FSDP's flat parameter views forbid writes there)."""

    def decayed_parameters(self) -> list[nn.Parameter]:
        """The scheme's parameters that get weight decay; by default none (position tables,
        bucket biases and kernel parameters are not pulled towards zero)."""
        return []

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        """What the scheme has learned, as curves to plot: name -> (x (N,), y (heads or
        curves, N), x label). Default, for a scheme with parameters and a bias: the bias at
        query position ``length`` against the distance i - j = 0..length, per head."""
        if not self.uses_bias or not any(True for _ in self.parameters()):
            return {}
        distance = torch.arange(length + 1)
        device = next(self.parameters()).device
        bias = self.bias(torch.tensor([length], device=device), (length - distance).to(device))
        return {"bias vs distance": (distance.float(), bias[:, 0].float().cpu(), "distance i - j")}

    def layer_terms(self, x: Tensor, layer: int, start: Tensor | None = None) -> Tensor:
        """(B, H, T) float64 c of layer ``layer``'s input x (B, T, C), continuing ``start`` (B, H, 1),
        the c of the token before x (a KV cache), if given; attention adds c_i - c_j (``terms="layer"``)."""
        raise NotImplementedError(f"pe={self.name} declares terms={self.terms!r}, not 'layer'")

    def rotate_layer(self, q: Tensor, k: Tensor, v: Tensor, angles: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v of one layer's new tokens turned by their ``layer_terms`` angles (``terms="rotation"``)."""
        raise NotImplementedError(f"pe={self.name} declares terms={self.terms!r}, not 'rotation'")

    def unrotate_output(self, y: Tensor, angles: Tensor) -> Tensor:
        """A ``terms="rotation"`` layer's output (or own values) turned back, where values were turned; else y."""
        return y

    @property
    def uses_layer_rotation(self) -> bool:
        return self.terms == "rotation"

    def score_terms(self, q: Tensor, scores: Tensor, visible: Tensor, layer: int) -> Tensor:
        """(B, H, Tq, Tk) extra logits of layer ``layer`` from its queries q (B, H, Tq, d), scaled scores
        q.k / sqrt(d) (B, H, Tq, Tk) and the visible keys (bool, broadcastable) (``terms="scores"``)."""
        raise NotImplementedError(f"pe={self.name} declares terms={self.terms!r}, not 'scores'")

    # Per-forward state of the rotation: computed once by the model and shared by all layers.
    def rotation_tables(self, positions: Tensor, span: Tensor) -> Any:
        """What ``apply_rotation`` needs to rotate the q and k of tokens at ``positions``.

        ``span`` holds every position the attention context covers (cached keys and, when
        generating, the tokens still to come): a scheme whose tables depend on the whole
        context (xPos's reference point, dynamic NTK's length) reads it from there, so keys
        rotated into a KV cache never need rotating again. Default: the positions themselves.
        """
        return positions

    def apply_rotation(self, q: Tensor, k: Tensor, tables: Any) -> tuple[Tensor, Tensor]:
        return self.rotate(q, k, tables, tables)

    # Which hooks this scheme implements, decided from the class, never from its name.
    @property
    def uses_embed(self) -> bool:
        return type(self).embed is not PositionEncoding.embed

    @property
    def uses_rotate(self) -> bool:
        return type(self).rotate is not PositionEncoding.rotate

    @property
    def uses_bias(self) -> bool:
        return type(self).bias is not PositionEncoding.bias

    def extra_repr(self) -> str:
        hooks = [h for h in ("embed", "rotate", "bias") if getattr(self, f"uses_{h}")]
        return f"scheme={self.name}, hooks={hooks}, max_positions={self.max_positions}"


def relative_distance(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(..., Tq, Tk) float32 matrix of i - j, computed exactly in integers first. Positions
    are (T,) or (B, T) (each sequence its own, e.g. randomized positions)."""
    return (q_positions[..., :, None] - k_positions[..., None, :]).float()


def is_window(positions: Tensor) -> bool:
    """1-D consecutive positions p0, p0 + 1, ... (a training window, a query chunk); read on the host."""
    return positions.dim() == 1 and (positions.numel() < 2 or bool((positions.diff() == 1).all()))


def reverse_rows(windows: Tensor, by_index: bool | None = None) -> Tensor:
    """``windows.flip(-2)`` materialised. On CUDA, for an output of 2 GiB or more (t5's table at
    T = 8192), by ``index_select`` instead (``by_index`` forces either way): CUDA's flip of this
    overlapping view stopped on an illegal memory access there (docs/gpu.md, 2026-11-26)."""
    if by_index is None:
        by_index = windows.is_cuda and windows.numel() * windows.element_size() >= 2**31
    if by_index:
        return windows.index_select(-2, torch.arange(windows.shape[-2] - 1, -1, -1, device=windows.device))
    return windows.flip(-2)


def distance_bias(values_of: Callable[[Tensor], Tensor], q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(..., H, Tq, Tk) bias[h, i, j] = values_of(d)[h] of d = p_i - p_j, for a bias of the
    distance alone; ``values_of`` maps integer distances (...) to float32 (..., H).

    Eager, it runs once per distinct distance, not once per (i, j) pair. Consecutive 1-D
    positions (Tq + Tk - 1 distances) are laid out as a Toeplitz matrix by strides, so the
    backward sums diagonals instead of scattering Tq * Tk indices (several times faster on
    CPU); other positions gather their distance range, unless it is larger than the pairs.
    Compiled graphs evaluate every pair (no host reads).
    """
    eager, device = not torch.compiler.is_compiling(), q_positions.device
    if eager and is_window(q_positions) and is_window(k_positions):
        Tq, Tk = q_positions.shape[-1], k_positions.shape[-1]
        nearest = int(q_positions[0]) - int(k_positions[-1])  # first query to last key
        values = values_of(torch.arange(nearest, nearest + Tq + Tk - 1, device=device))  # d = nearest + i - j + Tk - 1
        # row i holds values[i - j + Tk - 1] over j: windows of the reversed values, last window first
        return reverse_rows(values.t().flip(-1).unfold(-1, Tk, 1))
    distance = q_positions[..., :, None] - k_positions[..., None, :]
    if eager:
        lo, hi = int(distance.min()), int(distance.max())
        if hi - lo + 1 < distance.numel():  # else sparse far positions: fewer pairs than distances
            return values_of(torch.arange(lo, hi + 1, device=device))[distance - lo].movedim(-1, -3)
    return values_of(distance).movedim(-1, -3)


def per_head(values: Tensor, distance: Tensor) -> tuple[Tensor, Tensor]:
    """(H,) per-head values and a (..., Tq, Tk) distance, shaped to broadcast to (..., H, Tq, Tk)."""
    return values[:, None, None], distance.unsqueeze(-3)
