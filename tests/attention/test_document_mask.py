"""Packed documents in attention (data/packing.py, ``documents`` of ``GPT.hidden``): a document's
logits do not depend on what precedes it in the window, equal those of the document scored
alone, restart every scheme's positions, keep causality by token order, and give the learned
biases the gradients of a float64 loop that attends within documents only."""

from __future__ import annotations

import math

import pytest
import torch

from data.packing import document_layout
from model.attention import BACKENDS, Terms
from model.gpt import GPT
from model.pe import SCHEMES
from model.positions import Pass, layer_contexts
from tests.naive import leaf_params, naive_qkv, naive_scheme_bias
from tests.tiny import LEARNED_BIAS, SMALL_OPTIONS, build

EOT = 0  # the separator of these windows (token ids 1.. are text)
SCHEMES_ALL = sorted(SCHEMES)
# (model.attention, grad mode, query chunk): every backend; sdpa under autograd is bias_grad for a
# learned bias on CPU; sdpa_key falls back to sdpa for a scheme without a key-only form. Chunks of 8
# (sdpa) give a first, middle and last chunk; of 16 (flex, whose eager CPU calls are slow) a first
# and a last, the last document across both
ROUTES = [("sdpa", False, None), ("sdpa_key", False, None), ("flex", False, None), ("math", False, None),
          ("sdpa", True, None), ("sdpa", False, 8), ("flex", False, 16)]
ROUTE_IDS = [f"{a}{'-grad' if g else ''}{f'-chunk{c}' if c else ''}" for a, g, c in ROUTES]


def refused(name: str, attention: str) -> bool:
    """model.attention=flex cannot add a score-dependent scheme's terms (CoPE's; resolve raises)."""
    return BACKENDS[attention].strict and SCHEMES[name].terms not in (None, *BACKENDS[attention].terms)


def windows(seed: int, T: int = 32, ends: tuple[tuple[int, ...], ...] = ((4, 11), (2, 7, 11))) -> torch.Tensor:
    """(2, T) text tokens with a separator at each row's ``ends`` (the last document starts at 12)."""
    x = torch.randint(1, 31, (len(ends), T), generator=torch.Generator().manual_seed(seed))
    for row, cut in enumerate(ends):
        x[row, list(cut)] = EOT
    return x


def logits(model: GPT, idx: torch.Tensor, positions, documents, grad: bool, chunk: int | None) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        h = model.hidden(idx, positions, documents, how=Pass(q_chunk=chunk))
        return model.logits(h).detach()


@pytest.mark.parametrize("attention, grad, chunk", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("name", SCHEMES_ALL)
def test_document_logits_bit_identical_whatever_precedes_and_as_if_alone(name, attention, grad, chunk):
    """One set of forwards per route: with the mask alone and with mask+positions, the last
    document's logits are bit-identical whatever precedes it; with both options they are those
    of the document scored alone."""
    if refused(name, attention):
        pytest.skip(f"model.attention={attention} refuses pe={name} (tests/pe/test_cope.py)")
    _, model, _ = build(name, SMALL_OPTIONS.get(name), attention=attention)
    if grad and not any(True for _ in model.pe.parameters()):
        pytest.skip("autograd changes the route only for a learned bias")
    a = windows(0)
    b = windows(1, ends=((3, 9, 11), (11,)))  # other earlier tokens and documents, same last document
    b[:, 12:] = a[:, 12:]
    layouts = [document_layout(idx, EOT) for idx in (a, b)]
    for with_positions in (False, True):
        out = [logits(model, idx, positions if with_positions else None, documents, grad, chunk)
               for idx, (positions, documents) in zip((a, b), layouts)]
        assert torch.equal(out[0][:, 12:], out[1][:, 12:]), f"with_positions={with_positions}"
        assert not torch.equal(out[0][:, :12], out[1][:, :12])  # the earlier documents did change
    alone = logits(model, a[:, 12:], None, None, grad, chunk)  # positions 0.., causal only
    torch.testing.assert_close(out[0][:, 12:], alone, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "math", "flex"])
@pytest.mark.parametrize("name", SCHEMES_ALL)
def test_a_window_of_one_document_is_unchanged(name, attention):
    """No separator before the last token: the options change nothing."""
    if refused(name, attention):
        pytest.skip(f"model.attention={attention} refuses pe={name} (tests/pe/test_cope.py)")
    _, model, _ = build(name, SMALL_OPTIONS.get(name), attention=attention)
    idx = windows(3, ends=((31,), (5,)))[:1]
    positions, documents = document_layout(idx, EOT)
    assert positions.tolist() == [list(range(32))] and documents.tolist() == [[0] * 32]
    plain = logits(model, idx, None, None, False, None)
    packed = logits(model, idx, positions, documents, False, None)
    if attention == "math":  # the same float mask either way
        assert torch.equal(packed, plain)
    torch.testing.assert_close(packed, plain, atol=1e-6, rtol=1e-6)


RESTARTED = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6] + list(range(20))  # separators at 4 and 11 close documents


@pytest.mark.parametrize("name", SCHEMES_ALL)
def test_positions_only_restart_in_every_hook_and_causality_follows_order(name, monkeypatch):
    _, model, _ = build(name)
    pe = model.pe
    seen = []
    for hook in ("embed", "rotation_tables", "bias", "bias_score"):  # the hooks that receive positions
        original = getattr(pe, hook)

        def spy(*args, _original=original):
            seen.extend(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.long)
            return _original(*args)

        monkeypatch.setattr(pe, hook, spy)
    idx = windows(4)[:1]
    positions, _ = document_layout(idx, EOT)
    assert positions.tolist() == [RESTARTED]
    base = logits(model, idx, positions, None, False, None)
    assert all(p.tolist() == [RESTARTED] for p in seen)
    assert seen or not (pe.uses_embed or pe.uses_rotate or pe.uses_bias)  # NoPE has no hook to spy on
    # causality by token order: token 11 (position 6) never sees token 12 (position 0, later in the window)
    later = idx.clone()
    later[0, 12:] = (later[0, 12:] % 30) + 1
    assert torch.equal(logits(model, later, positions, None, False, None)[:, :12], base[:, :12])
    # no mask: the last document still sees the earlier ones
    earlier = idx.clone()
    earlier[0, :4] = (earlier[0, :4] % 30) + 1
    assert not torch.equal(logits(model, earlier, positions, None, False, None)[:, 12:], base[:, 12:])


def naive_document_attention(attn, x, biases, documents):
    """float64 c_proj(softmax(q k^T / sqrt(d) + bias) v) over keys j <= i of i's document;
    ``biases[b]`` (H, T, T) float64."""
    q, k, v = naive_qkv(attn, x)
    B, T, H, hd = q.shape
    C = H * hd
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            out = []
            for i in range(T):
                keys = [j for j in range(i + 1) if documents[b][j] == documents[b][i]]
                scores = torch.stack([q[b, i, h] @ k[b, j, h] / math.sqrt(hd) + biases[b][h, i, j] for j in keys])
                w = torch.softmax(scores, dim=0)
                out.append(sum(w[n] * v[b, j, h] for n, j in enumerate(keys)))
            heads.append(torch.stack(out))
        rows.append(torch.stack(heads, dim=1).reshape(T, C))
    return torch.stack(rows) @ attn.c_proj.weight.detach().double().T


@pytest.mark.parametrize("with_positions", [False, True], ids=["mask", "mask+positions"])
@pytest.mark.parametrize("backend", ["bias_grad", "math"])
@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_learned_bias_gradients_under_document_masks_match_float64(name, backend, with_positions):
    _, model, attn = build(name, block_size=16)
    pe = model.pe
    idx = windows(5, T=16, ends=((4, 9), (6,)))
    positions, documents = document_layout(idx, EOT)
    if not with_positions:
        positions = torch.arange(16)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6))
    weight = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ctx = layer_contexts(Terms(pe, positions, positions, q_documents=documents, k_documents=documents),
                         BACKENDS[backend])[0]
    pe.zero_grad()
    (attn(x, ctx) * weight.float()).sum().backward()
    got = {n: p.grad.double() for n, p in pe.named_parameters()}

    p = leaf_params(pe)
    rows = positions if positions.dim() == 2 else positions.expand(2, -1)
    biases = [naive_scheme_bias(name, pe, p, r.tolist(), r.tolist()) for r in rows]
    out = naive_document_attention(attn, x, biases, documents.tolist())
    (out * weight).sum().backward()
    assert got.keys() == {n for n, t in p.items() if t.requires_grad}
    # an absolute floor at float32 rounding of the largest gradient: FIRE's output bias shifts
    # whole rows, so its exact gradient is zero and float32 leaves rounding
    largest = max(p[n].grad.abs().max().item() for n in got)
    assert largest > 0
    for n, g in got.items():
        torch.testing.assert_close(g, p[n].grad, rtol=1e-4, atol=2e-6 * largest, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name, attention", [("alibi", "sdpa_key"), ("t5", "auto"), ("rope", "auto")])
def test_compiles_fullgraph_with_documents(name, attention):
    """The document mask inside a compiled training step: no graph break, eager's loss."""
    torch._dynamo.reset()
    _, model, _ = build(name, attention=attention)
    model.train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = windows(8)
    targets = torch.roll(idx, -1, dims=1)
    positions, documents = document_layout(idx, EOT)
    _, eager = model(idx, targets, positions, documents)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (9, 10):  # another layout: the same graph
            _, loss = compiled(idx, targets, positions, documents)
            loss.backward()
            idx2 = windows(seed, ends=((3, 20), (9,)))
            compiled(idx2, targets, *document_layout(idx2, EOT))
    torch.testing.assert_close(loss, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5", "nope"])
def test_flex_document_block_mask_compiles_fullgraph(name):
    """The document BlockMask built inside the compiled graph (forward: CPU flex has no backward)."""
    torch._dynamo.reset()
    _, model, _ = build(name, attention="flex")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = windows(11)
    layout = document_layout(idx, EOT)
    with torch.no_grad():
        eager = model(idx, None, *layout)[0]
        first = compiled(idx, None, *layout)[0]
        with torch._dynamo.config.patch(error_on_recompile=True):
            idx2 = windows(12, ends=((3, 20), (9,)))
            compiled(idx2, None, *document_layout(idx2, EOT))
    torch.testing.assert_close(first, eager, atol=1e-5, rtol=1e-5)


def test_flex_document_block_mask_skips_blocks_of_other_documents():
    """Two documents of 128 tokens (flex's block size): the block of document 1's queries
    against document 0's keys is skipped, the causal mask keeps it."""
    from model.attention.flex import Flex

    documents = torch.arange(256).div(128, rounding_mode="floor")[None]
    packed = Flex.document_mask(documents, 256, None)
    causal = BACKENDS["flex"].block_mask(256, 256, torch.device("cpu"))
    blocks = lambda m: int(m.kv_num_blocks.sum() + (0 if m.full_kv_num_blocks is None else m.full_kv_num_blocks.sum()))
    assert (blocks(causal), blocks(packed)) == (3, 2)


@pytest.mark.parametrize("name", [n for n in SCHEMES_ALL if SCHEMES[n].bias_of_distance])
def test_bias_of_distance_is_shift_invariant(name):
    """A scheme that declares its bias a function of p_i - p_j (document masks then compute it
    at token order's positions where the positions step by one inside every document) gives
    the same bias at positions shifted by any amount."""
    _, model, _ = build(name)
    p = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model.pe.bias(p, p), model.pe.bias(p + 37, p + 37))


@pytest.mark.parametrize("name", ["alibi", "rope", "learned"])
def test_attention_map_probe_keeps_documents_apart(name):
    from evaluation.attention_maps import eager_attention_pass

    _, model, _ = build(name)
    idx = windows(13)
    positions, documents = document_layout(idx, EOT)
    probs = eager_attention_pass(model, idx, positions, documents=documents).probs
    other = (documents[:, :, None] != documents[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
    for p in probs.values():
        assert torch.equal(p.masked_select(other.expand_as(p)), torch.zeros(int(other.expand_as(p).sum())))
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))
