"""What every registered scheme has: its name, a float64 reference per hook, construction from defaults
and its yaml, translation invariance if relative, and attention that is no longer permutation equivariant."""

from __future__ import annotations

import pytest
import torch

from model.gpt import GPT
from pelab.lit import LitGPT
from model.pe import SCHEMES, PositionEncoding
from tests import naive
from tests.naive import HOOK_TABLES, READS_QUERY_POSITION, naive_reference, naive_softmax_attention
from tests.tiny import attention_config, build, schemes_where, tiny_config


def hooks_with_a_reference(name: str) -> tuple[bool, bool, bool]:
    """(embed, rotate, bias): the hooks tests/naive.py holds a float64 reference of for pe=name."""
    return tuple(name in getattr(naive, table) for table in HOOK_TABLES.values())


def test_registry_names_every_scheme():
    for name, cls in SCHEMES.items():
        assert cls.name == name
    for table in (*HOOK_TABLES.values(), "NAIVE_SLOPES", "NAIVE_PARAMS"):  # no reference of an unknown scheme
        assert set(getattr(naive, table)) <= set(SCHEMES), table


def test_registering_a_taken_scheme_name_is_an_error():
    from model.pe.base import PositionEncoding

    before = dict(SCHEMES)
    with pytest.raises(ValueError, match="'rope' is already registered by model.pe.rope.RoPE"):
        class MyRoPE(PositionEncoding, name="rope"):
            pass
    assert SCHEMES == before


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_hook_has_a_float64_reference(name):
    """The hooks a registered scheme uses (embed, rotate, bias: docs/design.md, section 2) are
    exactly those tests/naive.py has a reference of, so the shared tests cover a new scheme."""
    pe = SCHEMES[name](tiny_config())
    for hook, table in HOOK_TABLES.items():
        if getattr(pe, hook):
            naive_reference(table, name)  # a missing one names the table to extend
        else:
            assert name not in getattr(naive, table), f"pe={name} has no {hook} hook but an entry in {table}"
    assert (pe.uses_embed, pe.uses_rotate, pe.uses_bias) == hooks_with_a_reference(name)
    base = PositionEncoding(tiny_config())
    assert (base.uses_embed, base.uses_rotate, base.uses_bias) == (False, False, False)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_registered_with_hooks_and_bench_style_construction(name, project_root):
    cfg = attention_config()
    pe = SCHEMES[name](cfg)  # scripts/bench.py: defaults only
    assert pe.name == name and (pe.uses_embed, pe.uses_rotate, pe.uses_bias) == hooks_with_a_reference(name)
    assert pe.max_positions == (cfg.block_size if name == "learned" else None)  # only the table is bounded
    assert (project_root / "conf" / "pe" / f"{name}.yaml").exists()
    cls = SCHEMES[name]
    lit = LitGPT(model=dict(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32),
                 pe={"_target_": f"{cls.__module__}.{cls.__name__}"}, optim={})
    logits, loss = lit(torch.randint(0, 31, (2, 12)), torch.randint(0, 31, (2, 12)))
    assert logits.shape == (2, 12, 31) and torch.isfinite(loss)


def test_max_positions():
    cfg = tiny_config(block_size=16)
    assert SCHEMES["learned"](cfg).max_positions == 16
    assert SCHEMES["learned"](cfg, max_positions=40).max_positions == 40
    for name in sorted(set(SCHEMES) - {"learned"}):
        assert SCHEMES[name](cfg).max_positions is None


def test_scheme_yaml_values_equal_constructor_defaults(project_root):
    """A scheme option has one default: the constructor's. Each conf/pe yaml may list an
    option (so `pe.KEY=` overrides work) only with that same value, so building a scheme in
    code (bench, tests, scripts) and from its yaml give the same model."""
    import inspect

    from model.pe.scaling import SCALING_DEFAULTS
    from model.pe.schedule import SCHEDULE_KEYS
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    yamls = sorted((project_root / "conf" / "pe").glob("*.yaml"))
    assert {p.stem for p in yamls} >= set(SCHEMES)
    presets = {"hope", "rope_half_truncated", "rope_frayed"}  # set options on purpose: tests/pe/test_rope_presets.py
    for path in (p for p in yamls if p.stem not in presets):
        with initialize_config_dir(str(project_root / "conf"), version_base="1.3"):  # as train.py composes it
            cfg = OmegaConf.to_container(compose("config", overrides=[f"pe={path.stem}"]).pe)
        for key in SCHEDULE_KEYS:  # model-level options (model/pe/schedule.py), off by default
            assert cfg.pop(key, None) is None
        assert cfg.pop("scaling", SCALING_DEFAULTS) == SCALING_DEFAULTS  # model/pe/scaling.py, applied after build
        module, _, cls_name = cfg.pop("_target_").rpartition(".")
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        params = inspect.signature(cls.__init__).parameters
        for key, value in cfg.items():
            assert key in params, f"{path.name}: {key} is not an option of {cls_name}"
            assert params[key].default == value, (
                f"{path.name}: {key}: {value!r} differs from the constructor default {params[key].default!r}")


@pytest.mark.parametrize("name", schemes_where(lambda pe: not pe.uses_embed and pe.name not in READS_QUERY_POSITION))
def test_relative_schemes_are_translation_invariant_in_gpt(name):
    """Relative-only schemes: shifting all positions by a constant leaves the logits unchanged."""
    torch.manual_seed(2)
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES[name](cfg)).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        ref, _ = model(idx)
        shifted, _ = model(idx, positions=torch.arange(100, 110))
    torch.testing.assert_close(shifted, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", schemes_where(lambda pe: pe.uses_embed))
def test_absolute_schemes_depend_on_absolute_position(name):
    torch.manual_seed(3)
    cfg = tiny_config(block_size=64)
    pe = SCHEMES[name](cfg)
    if name == "learned":
        torch.nn.init.normal_(pe.wpe.weight, std=1.0)
    model = GPT(cfg, pe).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx, positions=torch.arange(20, 28))
    assert (a - b).abs().max() > 1e-3


# --------------------------------------------------------------------------------------
# permutation equivariance without position information, broken by each scheme
# --------------------------------------------------------------------------------------


def noncausal_attention_output(attn, pe, x, positions):
    """Non-causal attention through the scheme's hooks (embed -> qkv/rotate -> bias), float64."""
    if pe.uses_embed:
        x = pe.embed(x, positions)
    q, k, v = attn.c_attn(x).view(*x.shape[:2], 3, attn.n_head, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = pe.rotate(q, k, positions, positions)  # the hook itself (identity for the bare base class)
    bias = pe.bias(positions, positions).double() if pe.uses_bias else None
    return naive_softmax_attention(q.double(), k.double(), v.double(), bias, causal=False)


def _perm_setup(seed=4):
    torch.manual_seed(seed)
    cfg = attention_config()
    T = 7
    x = torch.randn(2, T, cfg.n_embd, dtype=torch.float64)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    return cfg, T, x, perm


def test_no_position_information_is_permutation_equivariant():
    cfg, T, x, perm = _perm_setup()
    pe = PositionEncoding(cfg)
    _, model, attn = build("rope", {}, seed=5)  # only its attention weights are used
    attn = attn.double()
    positions = torch.arange(T)
    out = noncausal_attention_output(attn, pe, x, positions)
    out_perm = noncausal_attention_output(attn, pe, x[:, perm], positions)
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-12, rtol=1e-12)
    # and the bare interface contributes nothing
    assert pe.bias(positions, positions) is None
    assert torch.equal(pe.embed(x, positions), x)
    q = torch.randn(1, 2, T, 8)
    rq, rk = pe.rotate(q, q, positions, positions)
    assert rq is q and rk is q
    assert pe.max_positions is None


@pytest.mark.parametrize("name", schemes_where(lambda pe: pe.uses_embed or pe.uses_rotate or pe.uses_bias))
def test_each_scheme_breaks_permutation_equivariance(name):
    cfg, T, x, perm = _perm_setup()
    pe = SCHEMES[name](cfg).double()
    if name == "learned":
        with torch.no_grad():
            torch.nn.init.normal_(pe.wpe.weight, std=1.0)
    _, model, attn = build("rope", {}, seed=5)
    attn = attn.double()
    positions = torch.arange(T)
    out = noncausal_attention_output(attn, pe, x, positions)
    out_perm = noncausal_attention_output(attn, pe, x[:, perm], positions)
    assert (out_perm - out[:, perm]).abs().max().item() > 1e-3
