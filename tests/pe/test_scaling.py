"""Positions scaled in training (``pe.scaling``, model/pe/scaling.py): part of the scheme (every
forward, checkpoints, KV-cache decoding), ALiBi-type interpolation, base raise, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from model.generate import KVCache
from model.gpt import GPT
from model.pe import SCHEMES, RoPE
from model.pe.rope_scaling import RopeScaling
from model.pe.scaling import SCALING_DEFAULTS, apply_scaling, scaled, scaling_of
from tests import tiny
from tests.naive import SLOPES_4, naive_alibi_bias
from tests.pe.test_rope_scaling import naive_rotate, naive_thetas

ROPE_FAMILY = tiny.schemes_where(lambda pe: isinstance(pe, RoPE))  # RoPE and its subclasses (not PoPE)
LINEAR_ONLY = [("alibi", "linear"), ("pope", "linear")]  # schemes that take position interpolation alone
KINDS = {
    "linear": {}, "ntk": {}, "dynamic_ntk": {}, "yarn": {"beta_fast": 16.0}, "llama3": {"high_freq_factor": 8.0},
    "longrope": {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 2.0, 4.0, 8.0]},
}


def scaled_gpt(name, kind, seed=0, **cfg):
    cfg = tiny.attention_config(**cfg)  # head dim 8: 4 rotary pairs
    torch.manual_seed(seed)
    pe = SCHEMES[name](cfg)
    apply_scaling(pe, {"kind": kind, "factor": 4.0, "original_length": 8, **KINDS.get(kind, {})}, cfg.block_size)
    return GPT(cfg, pe).eval()


@pytest.mark.parametrize("name, kind", [(n, k) for n in ROPE_FAMILY for k in KINDS] + LINEAR_ONLY)
def test_trained_scaling_equals_the_same_scaling_set_for_evaluation(name, kind):
    """Training and evaluation scale through one ``scale`` hook (the formulas are tested against
    the references in test_rope_scaling, test_yarn, test_llama3, test_longrope, and
    test_alibi_linear_divides_distances)."""
    trained = scaled_gpt(name, kind)
    torch.manual_seed(0)
    plain = GPT(tiny.attention_config(), SCHEMES[name](tiny.attention_config())).eval()
    plain.load_state_dict(trained.state_dict())
    idx = torch.randint(0, 31, (2, 20))
    with torch.no_grad(), scaled(plain.pe, trained.pe.scaling):
        assert torch.equal(trained(idx)[0], plain(idx)[0])
    with pytest.raises(ValueError, match=f"refused: pe={name} was trained with pe.scaling.kind={kind}"):
        with scaled(trained.pe, RopeScaling("linear", 2.0, 8)):
            pass


@pytest.mark.parametrize("name, kind", [(n, k) for n in ROPE_FAMILY for k in KINDS] + LINEAR_ONLY)
def test_cache_decoding_with_trained_scaling_equals_the_full_forward(name, kind):
    model = scaled_gpt(name, kind)
    idx = torch.randint(0, 31, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(idx, 14, temperature=0, cache=True)  # to T = 20 > L = 8: longrope switches lists
        ref = model.generate(idx, 14, temperature=0, cache=False)
        assert torch.equal(out, ref)
        full, _ = model(out[:, :-1])
        kv = KVCache(len(model.blocks), torch.arange(out.shape[1] - 1))
        steps = [model.logits(model.hidden(out[:, :6], cache=kv))]
        for t in range(6, out.shape[1] - 1):
            steps.append(model.logits(model.hidden(out[:, t:t + 1], cache=kv)))
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name, kind", [("rope", "yarn"), ("xpos", "llama3"), ("rope_alibi", "linear"),
                                        ("alibi", "linear"), ("rope", "longrope")])
def test_checkpoint_round_trip_keeps_the_scaling(tmp_path, name, kind):
    from hydra.utils import get_class  # noqa: F401 - the pe config names the class

    from pelab.checkpoint import load_lit_gpt
    from pelab.lit import LitGPT

    cls = SCHEMES[name]
    scaling = {**SCALING_DEFAULTS, "kind": kind, "factor": 4.0, "original_length": 8, **KINDS[kind]}
    if kind == "longrope":
        scaling.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    lit = LitGPT(model=dict(vocab_size=31, block_size=32, n_layer=1, n_head=4, n_embd=32),
                 pe={"_target_": f"{cls.__module__}.{cls.__qualname__}", "scaling": scaling})
    import lightning

    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams),
                "pytorch-lightning_version": lightning.__version__}, tmp_path / "x.ckpt")
    back = load_lit_gpt(tmp_path / "x.ckpt")
    assert back.model.pe.scaling == lit.model.pe.scaling is not None
    idx = torch.randint(0, 31, (2, 24))
    with torch.no_grad():
        assert torch.equal(back.model.eval()(idx)[0], lit.model.eval()(idx)[0])


@pytest.mark.parametrize("name", ["alibi", "rope_alibi"])
def test_alibi_linear_divides_distances(name):
    """-m_h (i - j) / s per head, against ALiBi's slopes 2^(-8h/H) written out (H = 4)."""
    s = 2.5
    plain, pe = SCHEMES[name](tiny.attention_config()), SCHEMES[name](tiny.attention_config())
    apply_scaling(pe, {"kind": "linear", "factor": s}, 32)
    i, j = torch.tensor([0, 5, 17, 40]), torch.tensor([0, 2, 9, 33])
    got = pe.bias(i, j).double()
    for h in range(4):
        m = 2.0 ** (-8.0 * (h + 1) / 4)
        for a in range(4):
            for b in range(4):
                assert got[h, a, b].item() == pytest.approx(-m * (i[a] - j[b]).item() / s, rel=1e-6)
    for form in ("key_only_slopes",):  # the fused forms read the same slopes
        torch.testing.assert_close(getattr(pe, form)(), getattr(plain, form)() / s)
    score = pe.bias_score()
    assert score(torch.tensor(17), torch.tensor(9), torch.tensor(1)).item() == pytest.approx(got[1, 2, 2].item())
    if name == "rope_alibi":  # the rotation is interpolated too: angle (p / s) theta
        x = torch.randn(8)
        rq, _ = pe.rotate(x.reshape(1, 1, 1, 8), x.reshape(1, 1, 1, 8), torch.tensor([7]), torch.tensor([7]))
        torch.testing.assert_close(rq.reshape(-1).double(), naive_rotate(x, 7 / s, naive_thetas(8)),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("s", [2.5, 4.0])
def test_alibi_scaled_at_evaluation_equals_naive_alibi_of_distances_over_s(s):
    """Under ``scaled(linear s)`` every form of ALiBi's bias is the float64 -m_h (i - j) / s;
    on leaving the block (also by an error) the scheme is exactly as before."""
    pe = SCHEMES["alibi"](tiny.attention_config())
    slopes, i, j = pe.slopes, torch.tensor([0, 5, 17, 40]), torch.tensor([0, 2, 9, 33])
    reference = naive_alibi_bias(SLOPES_4, i, j) / s
    with scaled(pe, RopeScaling("linear", s, 8)):
        torch.testing.assert_close(pe.bias(i, j).double(), reference, atol=0, rtol=1e-6)
        score = pe.bias_score()(i[:, None], j[None, :], torch.arange(4)[:, None, None])
        torch.testing.assert_close(score.double(), reference, atol=0, rtol=1e-6)
        torch.testing.assert_close(pe.key_only_slopes().double(), torch.tensor(SLOPES_4).double() / s,
                                   atol=0, rtol=1e-6)
        assert pe.scaling.factor == s
    assert pe.slopes is slopes and pe.scaling is None
    with pytest.raises(RuntimeError, match="inside"), scaled(pe, RopeScaling("linear", s, 8)):
        raise RuntimeError("inside")
    assert pe.slopes is slopes and pe.scaling is None


@pytest.mark.parametrize("name, kind, allowed", [("alibi", "yarn", "one of none, linear for pe=alibi"),
                                                 ("t5", "linear", "none: pe=t5 has no positions to scale")])
def test_scaled_refuses_a_kind_the_scheme_does_not_take(name, kind, allowed):
    pe = SCHEMES[name](tiny.attention_config())
    with pytest.raises(ValueError, match=f"rope_scaling must be {allowed}, got '{kind}'"):
        with scaled(pe, RopeScaling(kind, 2.0, 8)):
            pass
    assert pe.scaling is None


def test_rope_alibi_keeps_its_bias_under_other_kinds():
    plain, pe = SCHEMES["rope_alibi"](tiny.attention_config()), SCHEMES["rope_alibi"](tiny.attention_config())
    apply_scaling(pe, {"kind": "yarn", "factor": 4.0, "original_length": 8}, 32)
    assert torch.equal(pe.slopes, plain.slopes)


def test_base_raise_is_a_plain_option():
    """Code Llama's ABF: pe.base=500000 with init_from, theta_k = 500000^(-2k/d)."""
    pe = SCHEMES["rope"](tiny.attention_config(), base=500000.0)
    got = pe.angles(torch.tensor([1]))[0].double().tolist()
    assert got == pytest.approx([500000.0 ** (-2 * k / 8) for k in range(4)], rel=1e-7)


@pytest.mark.parametrize("values, message", [
    ({"kind": "ntk_by_parts"}, "pe.scaling.kind must be one of none, linear"),
    ({"kind": "linear", "factor": 0}, "pe.scaling.factor must be a finite number >= 1"),
    ({"kind": "linear", "factor": 0.5}, "pe.scaling.factor must be a finite number >= 1"),
    ({"kind": "yarn", "factor": 2, "original_length": 64}, "pe.scaling.original_length must be null or an integer in "
                                                            "[1, model.block_size=32]"),
    ({"kind": "none", "factor": 4.0}, "pe.scaling.factor must be 1.0: pe.scaling.kind=none reads no other option"),
    ({"kind": "ntk", "factor": 2, "low_freq_factor": 2.0}, "pe.scaling.low_freq_factor must be 1.0: "
                                                           "pe.scaling.kind=ntk reads factor, original_length"),
    ({"kind": "llama3", "factor": 2, "beta_slow": 2.0}, "pe.scaling.beta_slow must be 1.0"),
    ({"kind": "longrope", "factor": 2}, "pe.scaling.kind longrope needs short_factor and long_factor"),
    ({"kind": "linear", "facter": 2}, "pe.scaling.facter must be absent"),
])
def test_bad_scaling_names_key_value_and_what_is_allowed(values, message):
    with pytest.raises(ValueError) as err:
        scaling_of(values, 32)
    assert message in str(err.value)


def test_kind_none_is_no_scaling():
    assert scaling_of(None, 32) is None and scaling_of(dict(SCALING_DEFAULTS), 32) is None
    assert math.isclose(scaling_of({"kind": "linear", "factor": 2}, 32).original_length, 32)
