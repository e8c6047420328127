"""Per-layer positions tied to the window pattern (model/pe/schedule.py ``layer_positions``):
NoPE on the full-attention or windowed layers (pe.nope_layers) and another RoPE base on the
full-attention layers (pe.global_base, Gemma 3), against schedules written out by hand and a
float64 model whose rotation is written from the RoPE formula; greedy cache = no cache; one
line for each bad value."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.pe.schedule import LAYER_KEYS, LayerRope, check_layer_rope, layer_positions
from tests.naive import naive_gelu, naive_layer_norm, naive_linear

W, F = 64, None  # a windowed and a full-attention layer
GEMMA = (W, W, W, W, W, F) * 2  # Gemma 3's 5 local : 1 global over 12 layers


@pytest.mark.parametrize("windows,options,nope,bases", [
    ((W, W, W, F) * 2, {"listed": "global"}, {3, 7}, {}),
    ((W, W, W, F) * 2, {"nope_every": 4}, {3, 7}, {}),  # RNoPE-SWA's two spellings agree
    ((W, W, W, F) * 2, {"listed": "local"}, {0, 1, 2, 4, 5, 6}, {}),
    ((W, F, W, F), {"listed": [0, 3]}, {0, 3}, {}),
    ((F,) * 4, {"nope_every": 2}, {1, 3}, {}),
    (GEMMA, {"global_base": 1e6}, set(), {5: 1e6, 11: 1e6}),
    ((W, F) * 2, {"listed": [1], "global_base": 5e5}, {1}, {3: 5e5}),  # the NoPE global layer has no base
    ((W, F) * 2, {}, set(), {}),
])
def test_schedules_are_the_layers_written_out(windows, options, nope, bases):
    got_nope, got_bases = layer_positions(windows, options.get("nope_every"), options.get("listed"),
                                          options.get("global_base"))
    assert got_nope == nope
    assert got_bases == tuple(None if bases.get(i) is None else LayerRope(bases[i]) for i in range(len(windows)))


@pytest.mark.parametrize("windows,options,message", [
    ((W, F), {"nope_every": 2, "listed": "global"}, "pe.nope_every=2 and pe.nope_layers='global': set one of the two"),
    ((W,) * 4, {"listed": "global"}, "pe.nope_layers=global needs both windowed and full-attention layers, "
                                     "but the model's layer windows are [64, 64, 64, 64]"),
    ((F,) * 4, {"listed": "local"}, "pe.nope_layers=local needs both windowed and full-attention layers"),
    ((W, F), {"listed": "globals"}, "pe.nope_layers must be null, global or local or a non-empty list of 0-based "
                                    "layer indices < model.n_layer=2, got 'globals'"),
    ((W, F), {"listed": [2]}, "layer indices < model.n_layer=2, got [2]"),
    ((W, F), {"listed": []}, "a non-empty list of 0-based layer indices"),
    ((W, F), {"global_base": 1}, "pe.global_base must be null or a number > 1"),
    ((F, F), {"global_base": 1e6}, "pe.global_base=1000000.0 needs both windowed and full-attention layers"),
    ((W, W), {"global_base": 1e6}, "pe.global_base=1000000.0 needs both windowed and full-attention layers"),
    ((W, F), {"listed": "global", "global_base": 1e6}, "sets the RoPE base of the full-attention layers [1], "
                                                       "but they are all NoPE layers"),
])
def test_bad_schedules_fail_with_one_line(windows, options, message):
    with pytest.raises(ValueError) as err:
        layer_positions(windows, options.get("nope_every"), options.get("listed"), options.get("global_base"))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_config_reaches_the_model_and_refusals_come_before_data():
    """pe.nope_layers / pe.global_base through build_position (what train.py validates before any
    data is read) and LitGPT; a base on a scheme without a rotation base is refused there."""
    from pelab.config import ConfigError
    from pelab.lit import LitGPT, build_position, model_config

    model = {"vocab_size": 41, "block_size": 32, "n_layer": 4, "n_head": 2, "n_embd": 16, "window_pattern": [8, None]}
    lit = LitGPT(model=model, pe={"_target_": "model.pe.rope.RoPE", "global_base": 1e6})
    assert lit.model.layer_rope == (None, LayerRope(1e6), None, LayerRope(1e6)) and not lit.model.nope_layers
    lit = LitGPT(model=model, pe={"_target_": "model.pe.xpos.XPos", "nope_layers": "global"})
    assert lit.model.nope_layers == {1, 3}
    config = model_config(model)
    with pytest.raises(ConfigError, match=r"pe.global_base=1000000.0 needs a RoPE scheme .*, got pe=alibi$"):
        build_position({"_target_": "model.pe.alibi.ALiBi", "global_base": 1e6}, config)
    with pytest.raises(ConfigError, match=r"pe.nope_layers=\[0, 1, 2, 3\] makes all 4 layers NoPE layers, so pe=t5"):
        build_position({"_target_": "model.pe.t5.T5RelativeBias", "nope_layers": [0, 1, 2, 3]}, config)
    with pytest.raises(ValueError, match="pe.global_base=100.0 needs a RoPE scheme"):
        check_layer_rope((None, LayerRope(100.0)), SCHEMES["kerple_log"](config))


def rotate(x: torch.Tensor, base: float, kept: int | None = None, factor: float = 1.0) -> torch.Tensor:
    """RoPE from its formula, half-split pairs (x_k, x_{k+d/2}) of a (B, H, T, d) float64 tensor at
    positions 0..T-1: angle (t / factor) * base^(-2k/d) (factor: linear interpolation), 0 for the
    pairs k >= kept (p-RoPE), (x1 cos - x2 sin, x2 cos + x1 sin)."""
    d, half = x.shape[-1], x.shape[-1] // 2
    out = x.clone()
    for t in range(x.shape[2]):
        for k in range(half):
            a = t / factor * base ** (-2 * k / d) if kept is None or k < kept else 0.0
            x1, x2 = x[:, :, t, k], x[:, :, t, k + half]
            out[:, :, t, k], out[:, :, t, k + half] = x1 * math.cos(a) - x2 * math.sin(a), x2 * math.cos(a) + x1 * math.sin(a)
    return out


def reference_logits(model: GPT, idx: torch.Tensor, windows: list, bases: list, turns: list | None = None
                     ) -> torch.Tensor:
    """float64 logits, layer l attending keys i - windows[l] + 1 .. i (None: all earlier) with its
    queries and keys rotated at bases[l] (None: no rotation), with ``rotate``'s options turns[l]."""
    x = model.wte.weight.detach().double()[idx]
    T = idx.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    for block, window, base, turn in zip(model.blocks, windows, bases, turns or [{}] * len(bases)):
        a, H = block.attn, model.config.n_head
        y = naive_linear(a.c_attn, naive_layer_norm(x, block.ln_1))
        q, k, v = (t.view(*idx.shape, H, -1).transpose(1, 2) for t in y.chunk(3, dim=-1))
        if base is not None:
            q, k = rotate(q, base, **turn), rotate(k, base, **turn)
        seen = (j <= i) & ((j > i - window) if window is not None else True)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, -math.inf)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
        x = x + naive_linear(a.c_proj, att)
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))))
    return naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T


def two_base_model(scaling: dict | None = None, **pe_options) -> GPT:
    from model.pe.scaling import apply_scaling

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=37, block_size=64, n_layer=2, n_head=2, n_embd=32, window_pattern=[3, None])
    nope, bases = layer_positions(config.layer_windows, None, pe_options.pop("nope_layers", None),
                                  *(pe_options.pop(key, None) for key in LAYER_KEYS[2:]))
    scheme = SCHEMES["rope"](config, **pe_options)
    apply_scaling(scheme, scaling, config.block_size)
    model = GPT(config, scheme, nope, bases).eval()
    with torch.no_grad():
        for block in model.blocks:  # sharper attention than GPT-2's init, so positions move the logits
            block.attn.c_attn.weight.mul_(8)
    return model


def test_two_bases_equal_the_float64_model_and_build_each_table_once(monkeypatch):
    """Layer 0 windowed at base 100, layer 1 full at base 1e6 (bases far apart, so a wrong table
    shows); each distinct base's tables are built once per forward."""
    model = two_base_model(base=100.0, global_base=1e6)
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))
    calls = []
    tables = model.pe.rotation_tables
    monkeypatch.setattr(model.pe, "rotation_tables", lambda *a, **k: calls.append((k.get("layer") or LayerRope()).base) or tables(*a, **k))
    with torch.no_grad():
        got = model(idx)[0]
    assert sorted(calls, key=str) == [1e6, None]
    expected = reference_logits(model, idx, [3, None], [100.0, 1e6])[..., :37]
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=0)
    one_base = reference_logits(model, idx, [3, None], [100.0, 100.0])[..., :37]
    assert (one_base - expected).abs().max() > 1e-2  # the global base matters
    nope = two_base_model(base=100.0, nope_layers="global")
    nope.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(nope(idx)[0].double(), reference_logits(model, idx, [3, None], [100.0, None])[..., :37],
                                   atol=2e-5, rtol=0)


def test_global_p_rope_and_global_scaling_equal_the_float64_model():
    """Gemma 4's p-RoPE on the global layers only (8 of 8 pairs rotate in the windowed layer, 2
    in the full one), OLMo 3's scaling on the full-attention layers only (linear interpolation by
    4 there, none in the windowed layer): each against RoPE written out, and each option matters."""
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))
    model = two_base_model(base=100.0, global_base=1e6, global_keep_fraction=0.25)
    assert model.layer_rope == (None, LayerRope(1e6, 0.25))
    with torch.no_grad():
        got = model(idx)[0].double()
    torch.testing.assert_close(got, reference_logits(model, idx, [3, None], [100.0, 1e6], [{}, {"kept": 2}])[..., :37],
                               atol=2e-5, rtol=0)
    assert (got - reference_logits(model, idx, [3, None], [100.0, 1e6])[..., :37]).abs().max() > 1e-2
    scaled = two_base_model(scaling={"kind": "linear", "factor": 4.0}, scaling_layers="global")
    scaled.load_state_dict(model.state_dict())
    assert scaled.layer_rope == (LayerRope(scaled=False), None)
    with torch.no_grad():
        got = scaled(idx)[0].double()
    turns = [{}, {"factor": 4.0}]
    torch.testing.assert_close(got, reference_logits(scaled, idx, [3, None], [10000.0] * 2, turns)[..., :37],
                               atol=2e-5, rtol=0)
    everywhere = reference_logits(scaled, idx, [3, None], [10000.0] * 2, [{"factor": 4.0}] * 2)[..., :37]
    assert (got - everywhere).abs().max() > 1e-3


@pytest.mark.parametrize("options, message", [
    ({"global_keep_fraction": 0}, "pe.global_keep_fraction must be null or a number in (0, 1]"),
    ({"scaling_layers": "local"}, "pe.scaling_layers must be null or one of 'all', 'global' (the layers pe.scaling "
                                  "rescales), got 'local'"),
    ({"global_keep_fraction": 0.25, "nope_layers": "global"}, "pe.global_keep_fraction=0.25 sets p-RoPE's kept "
                                                              "fraction of the full-attention layers [1], but they "
                                                              "are all NoPE layers"),
])
def test_bad_layer_rope_options_fail_with_one_line(options, message):
    with pytest.raises(ValueError) as err:
        two_base_model(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_global_options_need_both_kinds_of_layer():
    with pytest.raises(ValueError, match=r"pe.scaling_layers=global needs both windowed and full-attention layers"):
        layer_positions((None, None), None, None, None, None, "global")


@pytest.mark.parametrize("options", [{"global_base": 1e6}, {"nope_layers": "global"}])
def test_greedy_decoding_with_the_cache_equals_without(options):
    model = two_base_model(base=100.0, **options)
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = model.generate(prompt, 15, temperature=0)
        assert torch.equal(cached, model.generate(prompt, 15, temperature=0, cache=False))


def test_gemma3_like_preset_is_five_local_layers_then_a_global_one(project_root, n_layer=12):
    """experiment=gemma3_like as train.py composes it: layer i is global iff i % 6 == 5, the global
    layers rotate at base 1M and the windowed ones at 10k, with Gemma 3's block options."""
    from hydra import compose, initialize_config_dir

    from pelab.config import plain
    from pelab.lit import build_position, model_config

    with initialize_config_dir(str(project_root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=gemma3_like", f"model.n_layer={n_layer}"])
    config = model_config({"vocab_size": 1, **plain(cfg.model)})
    full = [i for i in range(n_layer) if i % 6 == 5]
    assert [i for i, w in enumerate(config.layer_windows) if w is None] == full
    assert all(w == 64 for i, w in enumerate(config.layer_windows) if i not in full)
    position = build_position(plain(cfg.pe), config)
    assert position.scheme.base == 10000 and not position.nope_layers
    assert position.layer_rope == tuple(LayerRope(1e6) if i in full else None for i in range(n_layer))
    assert (config.norm, config.qk_norm, config.kv_heads, config.n_head) == ("rmsnorm", True, 2, 4)
