"""Every backend of one scheme computes the same model: the scheme's terms at the positions given
(randomized ones included) under document masks, in every compute dtype, against float64
references (a naive loop over the bias formulas, and the float64 model scoring each document alone)."""

from __future__ import annotations

import copy

import pytest
import torch

from data.packing import document_layout
from model.attention import BACKENDS, AttentionRequest, Terms, resolve
from model.pe import SCHEMES
from model.pe.schedule import random_positions
from model.positions import Pass, layer_contexts
from pelab.lit import COMPUTE_DTYPES
from tests.attention.test_document_mask import EOT, naive_document_attention, windows
from tests.naive import leaf_params, naive_scheme_bias
from tests.tiny import build, schemes_where

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes, hundreds of forwards: one intra-op thread (a second one only adds its
    fork/join to every op: 3 to 10 times slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
# schemes whose only position term is a bias (the naive loop below has no rotation)
BIAS_ONLY = schemes_where(lambda pe: pe.uses_bias and not (pe.uses_rotate or pe.uses_embed))


def naive_bias64(name, pe, qpos, kpos):
    """(H, Tq, Tk) float64 bias at the given integer positions, from the scheme's formula in
    tests/naive.py (ALiBi: MPT's -m_h (p_i - p_j) with the slopes typed in)."""
    return naive_scheme_bias(name, pe, leaf_params(pe), qpos, kpos).detach()


def randomized_layout(seed: int, T: int, limit: int = 64):
    """(2, T) randomized positions (sorted subsets of [0, limit)) and the document ids of a window."""
    positions = random_positions(2, T, limit, torch.Generator().manual_seed(seed))
    idx = windows(seed, T=T, ends=((4, 9), (6,)))
    return positions, document_layout(idx, EOT)[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", BIAS_ONLY)
def test_randomized_positions_under_a_document_mask_on_every_backend(name, dtype):
    """pe.randomize_to with data.document_mask: the bias at the randomized positions, not at token
    order's (which the mask-building backends once substituted for a bias of the distance alone),
    on every backend that runs the scheme, against a float64 loop over each document's keys; in
    float64 too (SDPA's CPU kernels once added a float32 mask to float64 scores wrongly)."""
    _, model, attn = build(name, block_size=16)
    model.to(dtype)
    positions, documents = randomized_layout(3, T=16)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4), dtype=dtype)
    rows = positions.tolist()
    biases = [naive_bias64(name, model.pe, r, r) for r in rows]
    ref = naive_document_attention(attn, x, biases, documents.tolist())
    ran = []
    for backend in BACKENDS.values():
        grad = backend.name == "bias_grad"  # the learned-bias kernel runs under autograd only
        if backend.refusal(AttentionRequest(model.pe, CPU, dtype, 0.0, grad)) is not None:
            continue
        terms = Terms(model.pe, positions, positions, dtype=dtype, q_documents=documents, k_documents=documents)
        ctx = layer_contexts(terms, backend)[0]
        with torch.set_grad_enabled(grad):
            out = attn(x, ctx).detach()
        torch.testing.assert_close(out.double(), ref, atol=2e-5 if dtype == torch.float32 else 1e-6,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-6,
                                   msg=lambda m: f"{backend.name}: {m}")
        ran.append(backend.name)
    assert {"sdpa", "math", "flex"} <= set(ran)


# --------------------------------------------------------------------------------------
# the registry: every scheme x backend x compute dtype x position layout against float64
# --------------------------------------------------------------------------------------

T, LIMIT = 16, 32  # window length; randomized positions are drawn from [0, LIMIT) (learned's table: 32)
# name: (document mask, positions restart per document, randomized positions)
LAYOUTS = {"plain": (False, False, False), "mask": (True, False, False), "positions": (False, True, False),
           "both": (True, True, False), "randomized": (False, False, True), "randomized+mask": (True, False, True)}
# the compute dtypes of trainer.precision; below 32 bits as *-mixed (autocast), else the model in that dtype
DTYPES = sorted(set(COMPUTE_DTYPES.values()), key=str)
# worst |logit - float64 logit| allowed, as a fraction of the largest float64 logit
TOLERANCE = {torch.float64: 5e-7, torch.float32: 3e-6, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def layout(name: str, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(positions, documents) of the windows ``idx`` in the layout ``name``."""
    mask, restart, randomized = LAYOUTS[name]
    positions, documents = document_layout(idx, EOT)
    if randomized:
        positions = random_positions(idx.shape[0], idx.shape[1], LIMIT, torch.Generator().manual_seed(5))
    elif not restart:
        positions = None
    return positions, documents if mask else None


def reference_logits(model, idx: torch.Tensor, positions, documents) -> torch.Tensor:
    """float64 logits of the model with the ``math`` backend, every sequence and (under a mask)
    every document scored alone at its own positions, as given: no document mask, no batch."""
    model64 = copy.deepcopy(model).double()
    positions = torch.arange(idx.shape[1]).expand_as(idx) if positions is None else positions
    out = torch.empty(*idx.shape, model.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for b in range(idx.shape[0]):
            ids = torch.zeros(idx.shape[1], dtype=torch.long) if documents is None else documents[b]
            for d in ids.unique():
                where = (ids == d).nonzero()[:, 0]
                h = model64.hidden(idx[b, where][None], positions[b, where], how=Pass(attention="math"))
                out[b, where] = model64.logits(h)[0]
    return out


def run(models: dict, backend: str, dtype: torch.dtype, idx, positions, documents, chunk: int | None = None
        ) -> torch.Tensor | None:
    """Logits in ``dtype`` with the backend ``backend``, or None where it does not run (the
    device, the dtype, the scheme or the grad mode: ``resolve`` would pick another);
    bias_grad under autograd, every other one without. ``models``: the model in each dtype
    (float32 for the mixed ones); ``chunk``: attention in query chunks of this size."""
    grad = backend == "bias_grad"
    mixed = dtype.itemsize < 4
    model = models[torch.float32 if mixed else dtype]
    if model.pe.terms not in (None, "rotation", *BACKENDS[backend].terms):  # rotation: before any backend (rope_dd)
        return None  # refused by resolve: it cannot add the scheme's data-dependent terms
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=dtype, enabled=mixed):
        if resolve(backend, AttentionRequest(model.pe, CPU, dtype, grad=grad, queries=idx.shape[1])).name != backend:
            return None
        return model.logits(model.hidden(idx, positions, documents,
                                         how=Pass(q_chunk=chunk, attention=backend))).detach()


def sweep(backend: str) -> list[tuple[str, torch.dtype, int | None]]:
    """(layout, dtype, query chunk) a backend is run in: every layout in every dtype, and in
    float32 in query chunks of 5 too (long evaluations: each chunk's rows prepared alone). A
    backend that runs traced eagerly on CPU (flex: each call traces its score function anew, 0.3
    to 1.5 s) gets the one layout that exercises all it reads, per-sequence positions out of
    token order under a document mask, in float32; its other layouts are in
    tests/attention/test_document_mask.py and test_backends.py."""
    compiled_on = getattr(BACKENDS[backend], "compile_devices", None)
    if compiled_on is not None and CPU.type not in compiled_on:
        return [("randomized+mask", torch.float32, None)]
    return [(lay, dtype, None) for lay in LAYOUTS for dtype in DTYPES] + [(lay, torch.float32, 5) for lay in LAYOUTS]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_backend_and_dtype_computes_the_float64_model(name):
    """For each registered scheme, every registered backend that runs it on CPU, every compute
    dtype and every position layout (plain, document mask, document positions, both, randomized,
    randomized with a mask), in float32 also in query chunks: the logits of the float64 model
    scoring each document alone."""
    _, model, _ = build(name, block_size=32, n_layer=1)
    models = {dtype: copy.deepcopy(model).to(dtype) for dtype in DTYPES if dtype.itemsize >= 4}
    idx = windows(6, T=T, ends=((4, 9), (6,)))
    failures, ran = [], set()
    for lay in LAYOUTS:
        positions, documents = layout(lay, idx)
        ref = reference_logits(model, idx, positions, documents)
        scale = ref.abs().max().item()
        for backend in sorted(BACKENDS):
            for dtype, chunk in [(d, c) for la, d, c in sweep(backend) if la == lay]:
                out = run(models, backend, dtype, idx, positions, documents, chunk)
                if out is None:
                    continue
                ran.add((backend, dtype))
                error = (out.double() - ref).abs().max().item() / scale
                if not error <= TOLERANCE[dtype]:
                    failures.append(f"{backend} {str(dtype).removeprefix('torch.')} {lay}"
                                    f"{f' chunks of {chunk}' if chunk else ''}: {error:.2e}")
    assert not failures, "\n".join(failures)
    assert {("math", d) for d in DTYPES} <= ran
