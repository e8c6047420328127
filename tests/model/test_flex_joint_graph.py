"""Every scheme's flex backward, as Inductor would build it on CUDA, checked on CPU.

CPU flex has no backward kernel, so nothing else on CPU reaches the step where Inductor lowers
flex's backward: it builds the joint (forward + backward) graph of the score_mod and refuses
one that indexes a captured tensor which requires gradients more than once
(``validate_joint_graph``; torch 2.11 also fails on a 0-dim captured tensor that requires
gradients). Here the flex backend runs under autograd, compiled on CPU by a backend that only
records dynamo's graph; the flex call's score_mod and captured tensors are read from it, the
joint graph is built by torch's own ``create_fw_bw_graph`` and checked by Inductor's own
``validate_joint_graph`` — so a scheme whose CUDA training route cannot compile fails here."""

from __future__ import annotations

import warnings

import pytest
import torch

from model.attention import BACKENDS, NORMALISERS, Terms
from model.pe import SCHEMES
from model.positions import layer_contexts
from tests.tiny import attention_config

torch.set_num_threads(2)

CPU = torch.device("cpu")
# the schemes with a flex score_mod: a bias with an elementwise form
SCORE_MOD_SCHEMES = [n for n in sorted(SCHEMES) if SCHEMES[n](attention_config()).bias_score() is not None]


def flex_calls(monkeypatch, pe, positions: torch.Tensor, layer_terms: tuple | None = None,
               sink: torch.Tensor | None = None) -> list:
    """The flex HOP nodes (with their graph) of one flex-backend attention call under autograd;
    ``layer_terms``: a data-dependent scheme's float64 c of the queries and keys, added to the
    state; ``sink``: (H,) sink logits."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    flex, recorder = BACKENDS["flex"], EagerAndRecordGraphs()
    monkeypatch.setattr(flex, "compile_devices", ("cpu",))
    monkeypatch.setattr(flex, "compile_backend", recorder)
    monkeypatch.setattr(flex, "_compiled", None)
    ctx = layer_contexts(Terms(pe, positions, positions), flex)[0]
    state = ctx.state if layer_terms is None else flex.add_layer_terms(ctx.state, *layer_terms, torch.bfloat16)
    q, k, v = (torch.randn(2, pe.n_head, positions.shape[-1], 8) for _ in range(3))  # CPU flex: no q/k/v grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = NORMALISERS["softmax" if sink is None else "sink_learned"].attend(flex, q, k, v, state, 0.0, sink)
    assert out.requires_grad or not any(p.requires_grad for p in pe.parameters())
    return [(gm, node) for gm in recorder.graphs for node in gm.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.higher_order.flex_attention]


def check_joint_graph(gm, node) -> list[torch.Tensor]:
    """Inductor's pre-lowering checks of the flex backward of one HOP call; its captured tensors."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    score_mod = getattr(gm, node.args[3].target)
    captured = tuple(b.meta["example_value"] for b in node.args[7])  # score_mod_other_buffers
    index_values = (torch.zeros((), requires_grad=True), *(torch.zeros((), dtype=torch.int) for _ in range(4)))
    with TransformGetItemToIndex():  # as flex's autograd op builds it
        _, joint = create_fw_bw_graph(score_mod, index_values, captured)
    joint.graph.eliminate_dead_code()  # as the lowering does
    validate_joint_graph(joint.graph)
    for b in captured:  # torch 2.11's lowering asserts on a 0-dim captured gradient (fixed after 2.11)
        assert not (b.requires_grad and b.dim() == 0), "a 0-dim captured tensor that requires grad"
    return list(captured)


@pytest.mark.parametrize("name", SCORE_MOD_SCHEMES)
def test_flex_backward_of_every_score_mod_passes_inductors_checks(monkeypatch, name):
    """Per-sequence positions, some past the training length (FIRE's normaliser changes with the
    query there), as packed or randomized positions give; a scheme that flex reads through its
    bias() table (``flex_reads_bias``) also with shared positions 0..T-1 (another table shape).
    Other schemes' score_mod is the same code for both."""
    torch.manual_seed(0)
    pe = SCHEMES[name](attention_config(block_size=16))
    layouts = [torch.stack([torch.arange(16), torch.arange(10, 26)])]
    if getattr(pe, "flex_reads_bias", False):
        layouts.append(torch.arange(16))
    for positions in layouts:
        calls = flex_calls(monkeypatch, pe, positions)
        assert len(calls) == 1
        captured = check_joint_graph(*calls[0])
        learned = [b for b in captured if b.requires_grad]
        assert bool(learned) == any(True for _ in pe.parameters())  # the check saw the learned tensors


@pytest.mark.parametrize("sinks", [False, True])
def test_flex_backward_of_layer_terms_passes_inductors_checks(monkeypatch, sinks):
    """FoX's c_i - c_j in score_mod, four captured (B, H, T) terms: the float32 head of the keys'
    c requires gradients (into the gates), and with sinks the queries' head too, each indexed once."""
    torch.manual_seed(0)
    pe = SCHEMES["fox"](attention_config(block_size=16))
    c = pe.layer_terms(torch.randn(2, 16, pe.gates[0].in_features), 0)
    calls = flex_calls(monkeypatch, pe, torch.arange(16), (c, c), torch.zeros(pe.n_head) if sinks else None)
    assert len(calls) == 1
    captured = check_joint_graph(*calls[0])
    assert [b.shape for b in captured if b.requires_grad] == [(2, pe.n_head, 16)] * (2 if sinks else 1)


def test_the_check_refuses_a_score_mod_that_indexes_a_learned_tensor_twice(monkeypatch):
    """The check itself: T5's table read twice (the pattern of an MLP unrolled over its hidden
    units) is refused with Inductor's message."""
    torch.manual_seed(0)
    pe = SCHEMES["t5"](attention_config(block_size=16))
    one = pe.bias_score()
    monkeypatch.setattr(pe, "bias_score", lambda: lambda q, k, h: one(q, k, h) + 0.5 * one(q, k + 1, h))
    calls = flex_calls(monkeypatch, pe, torch.arange(16))
    with pytest.raises(NotImplementedError, match="multiple indexing operations on the same tensor"):
        check_joint_graph(*calls[0])
