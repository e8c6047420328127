"""Remote-code export (pelab/hf_remote/): the model exported as itself, a flat copy of model/ and a
thin wrapper, loads with ``trust_remote_code=True`` and computes pelab's logits (float32, max abs
diff <= 1e-4) and pelab's greedy text (model/generate.py with its KV cache, temperature 0);
transformers' ``generate`` with its cache (pelab's KVCache) gives the text it gives without. The
cases come from the registry (every scheme, plain and with every attention option it allows), plus
the options no native class holds; a scheme written in this file exports with no other edit. The
reference is pelab's own model on the same weights and ids, its scheme parameters off their init."""

import ast
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from model.output_ops import OUTPUTS  # noqa: E402
from model.pe import SCHEMES  # noqa: E402
from model.pe.schedule import SCHEDULE_KEYS  # noqa: E402
from pelab.config import ConfigError  # noqa: E402
from pelab.export import ExportError, export_model, exporter_for, unexportable  # noqa: E402
from pelab.hf_remote import AUTO_MAP, REGISTRY, TEMPLATES, flat_name, model_modules  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB, LENGTH, PROMPT, NEW = 61, 32, 8, 24  # greedy text: 8 + 24 tokens, within the training length
PAIRS = 8  # rotary pairs of a 16-dim head
YARN = {"kind": "yarn", "factor": 2.0, "original_length": 16}
LLAMA3 = {"kind": "llama3", "factor": 4.0, "original_length": 16, "low_freq_factor": 1.5, "high_freq_factor": 6.0}
LONGROPE = {"kind": "longrope", "factor": 2.0, "short_factor": [1.0 + k / 8 for k in range(PAIRS)],
            "long_factor": [1.0 + k for k in range(PAIRS)]}
# every attention option at once: a window pattern, learned sinks, GQA, QK-norm and each operation on
# the attention output (model/output_ops/) as a per-layer list of its kinds
ATTENTION = dict(window_pattern=[8, None], sinks="learned", n_kv_head=2, qk_norm=True,
                 **{op.key: list(op.kinds[1:]) for op in OUTPUTS})
SKIPPED: dict[str, list[str]] = {}  # scheme -> the ATTENTION options its model refuses (none today)

# name: (pe scheme, its options, model options): the options no native class holds
OPTION_CASES = {
    "learned_window_bias": ("learned", {}, dict(window=8, bias=True, pad_vocab_multiple=16)),
    "rope_p_learned_freq_yarn": ("rope", {"keep_fraction": 0.5, "learnable_freq": True, "scaling": YARN}, {}),
    "rope_hope_half_dynamic_ntk": ("rope", {"max_period": 40.0, "rotary_fraction": 0.5,
                                            "scaling": {"kind": "dynamic_ntk", "factor": 2.0}}, {}),
    "rope_min_frequency_ntk_qk_norm": ("rope", {"min_frequency": 0.01, "scaling": {"kind": "ntk", "factor": 2.0}},
                                       dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, n_kv_head=2)),
    "rope_longrope_nope_llama4": ("rope", {"base": 500.0, "nope_every": 2, "scaling": LONGROPE},
                                  dict(attn_temperature="llama4", attn_temperature_floor=4)),
    "alibi_linear_log_length": ("alibi", {"scaling": {"kind": "linear", "factor": 2.0}},
                                dict(attn_temperature="log_length")),
    "xpos_half_llama3_pattern": ("xpos", {"rotary_fraction": 0.5, "scaling": LLAMA3}, dict(window_pattern=[8, None])),
    "rope_alibi_ssmax": ("rope_alibi", {"bias_heads": 2, "slope_multiplier": 0.5}, dict(attn_temperature="ssmax")),
    "fire": ("fire", {"mlp_width": 8}, {}),
    "kerple_power_swiglu": ("kerple_power", {}, dict(mlp="swiglu")),
    "nope_llama4": ("nope", {}, dict(attn_temperature="llama4", attn_temperature_floor=4,
                                     attn_temperature_scale=0.5)),
    "t5_rmsnorm": ("t5", {"num_buckets": 8, "max_distance": 20}, dict(norm="rmsnorm")),
    "cope_clamped_window_gqa": ("cope", {"npos_max": 6}, dict(window_pattern=[8, None], n_kv_head=2)),
    "alibi_zero_sinks_gqa": ("alibi", {}, dict(sinks="zero", n_kv_head=2)),
    "rope_stick_breaking_window": ("rope", {}, dict(normaliser="stick_breaking", window=8)),
    "rope_global_base": ("rope", {"base": 100.0, "global_base": 10000.0}, dict(window_pattern=[8, None])),
    "gemma4_global_p_rope": ("rope", {"base": 100.0, "global_base": 10000.0, "global_keep_fraction": 0.5},
                             dict(window_pattern=[8, None])),
    "olmo3_global_yarn": ("rope", {"scaling": YARN, "scaling_layers": "global"}, dict(window_pattern=[8, None])),
    # SWAN-GPT's inference-time scaling: from 8 keys on (within the greedy text) on the full layers
    "swan_global_logn": ("rope", {"nope_layers": "global"},
                         dict(window_pattern=[8, None], attn_temperature="logn", attn_temperature_length=8,
                              attn_temperature_layers="global")),
    "rope_differential_gqa_sinks_xsa": ("rope", {}, dict(attention_kind="differential", n_kv_head=2,
                                                         normaliser="sink_learned", xsa="gated")),
    "rope_dd_linear_rotate_v_differential": ("rope_dd", {"rotate_v": True, "step": "linear"},
                                             dict(attention_kind="differential", n_kv_head=2)),
}
assert "global_base" in SCHEDULE_KEYS


def target(scheme: str) -> str:
    cls = SCHEMES[scheme]
    return f"{cls.__module__}.{cls.__qualname__}"


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight off its init (the scheme's too: T5's table, KERPLE's r, FIRE's MLP, c and threshold,
    learned frequencies, ssmax's s_h, the sinks), so logits are spread and a misplaced term shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(noise * 0.1) if p.dim() == 1 else p.copy_(noise / math.sqrt(p.shape[-1]))


def build(scheme: str, pe_options: dict, model_options: dict, spread: bool = True):
    """(pelab's GPT, its pe config), built as train.py builds a run."""
    torch.manual_seed(0)
    model = dict(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=64, **model_options)
    pe = {"_target_": target(scheme), **pe_options}
    gpt = LitGPT(model=model, pe=pe).model.eval()
    if spread:
        spread_weights(gpt, seed=1)
    return gpt, pe


def allowed_attention(scheme: str) -> tuple[dict, list[str]]:
    """ATTENTION less the options the scheme's model refuses (asked by building it), and those."""
    refused = []
    for key, value in ATTENTION.items():
        try:
            build(scheme, {}, {key: value}, spread=False)
        except (ConfigError, ValueError):
            refused.append(key)
    return {k: v for k, v in ATTENTION.items() if k not in refused}, refused


def registry_cases() -> tuple[dict, dict]:
    cases, skipped = {}, {}
    for scheme in SCHEMES:
        options, refused = allowed_attention(scheme)
        cases[f"{scheme}-plain"] = (scheme, {}, {})
        cases[f"{scheme}-attention"] = (scheme, {}, options)
        if refused:
            skipped[scheme] = refused
    return cases, skipped


REGISTRY_CASES, REFUSED = registry_cases()
CASES = {**REGISTRY_CASES, **OPTION_CASES}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: threads only wait on each other (40x slower on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def export_case(root: Path, name: str, case) -> tuple:
    gpt, pe = build(*case)
    # every folder named hf: transformers imports one copy of the (identical) code for all of them
    result = export_model(gpt, root / name / "hf", pe_config=pe)
    native = unexportable(gpt, pe) is None  # a plain learned or rope model keeps its native class
    assert result.architecture == (exporter_for(gpt).architecture if native else "PelabForCausalLM"), result
    return gpt, result.path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (pelab's GPT, the folder it was exported to), each built and written once."""
    root = tmp_path_factory.mktemp("remote")
    return {name: export_case(root, name, case) for name, case in CASES.items()}


def load(out: Path):
    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()


def greedy(hf, prompt, new=NEW, **kwargs):
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new,
                       eos_token_id=None, **kwargs)


def test_every_registered_scheme_has_its_cases_and_refusals_are_named():
    assert {scheme for scheme, _, _ in REGISTRY_CASES.values()} == set(SCHEMES)
    assert REFUSED == SKIPPED  # a scheme that newly refuses an attention option is named in SKIPPED
    untested = sorted(set(SCHEMES) - {scheme for scheme, _, _ in CASES.values()})
    assert not untested


@pytest.mark.parametrize("name", CASES)
def test_remote_code_gives_pelab_logits_and_greedy_text_with_and_without_the_cache(exported, name):
    gpt, out = exported[name]
    hf = load(out)
    T = LENGTH if gpt.pe.max_positions else LENGTH + 8  # past the training length where the scheme can go
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = gpt(ids)[0], hf(ids).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std() > 0.5  # spread logits: the comparison is not of near-constants

    prompt = ids[:1, :PROMPT]
    text = greedy(hf, prompt)
    assert text.tolist() == gpt.generate(prompt, NEW, temperature=0).tolist()
    assert greedy(hf, prompt, use_cache=False).tolist() == text.tolist()


def test_a_folder_written_with_layer_bases_still_loads(exported, tmp_path):
    """config.json before layer_rope held ``layer_bases`` (a RoPE base or null per layer)."""
    import shutil

    gpt, out = exported["rope_global_base"]
    old = tmp_path / "hf"
    shutil.copytree(out, old)
    config = json.loads((old / "config.json").read_text())
    config["layer_bases"] = [None if r is None else r[0] for r in config.pop("layer_rope")]
    assert config["layer_bases"] == [None, 10000.0]
    (old / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (load(old)(ids).logits - gpt(ids)[0]).abs().max().item() <= 1e-4


def test_generate_with_the_cache_feeds_one_token_a_step(exported):
    gpt, out = exported["xpos_half_llama3_pattern"]  # a span-dependent scheme (xPos's reference point)
    hf = load(out)
    fed, hidden = [], hf.model.hidden

    def counting(idx, *args, **kwargs):
        fed.append(idx.shape[1])
        return hidden(idx, *args, **kwargs)

    hf.model.hidden = counting
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    assert greedy(hf, prompt, new=6).tolist() == gpt.generate(prompt, 6, temperature=0).tolist()
    assert fed == [PROMPT] + [1] * 5
    fed.clear()
    greedy(hf, prompt, new=6, use_cache=False)
    assert fed == list(range(PROMPT, PROMPT + 6))


@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_generates_each_prompt_as_alone(exported, use_cache):
    gpt, out = exported["alibi_linear_log_length"]
    hf = load(out)
    prompts = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompts[1:, 3:]), dim=1)
    batch = torch.cat((prompts[:1], padded))
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    text = hf.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None,
                       use_cache=use_cache)
    assert text[0].tolist() == gpt.generate(prompts[:1], 8, temperature=0)[0].tolist()
    assert text[1, 3:].tolist() == gpt.generate(prompts[1:, 3:], 8, temperature=0)[0].tolist()


def test_labels_give_pelab_next_token_loss(exported):
    gpt, out = exported["rope_alibi_ssmax"]
    hf = load(out)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert hf(ids, labels=ids).loss.item() == pytest.approx(gpt(ids[:, :-1], targets=ids[:, 1:])[1].item(),
                                                                abs=1e-5)


def test_folder_holds_the_model_itself_the_wrapper_verbatim_and_auto_map(exported):
    gpt, out = exported["t5_rmsnorm"]
    for name in TEMPLATES:
        assert (out / name).read_bytes() == (ROOT / "pelab" / "hf_remote" / name).read_bytes()
    for module, path in model_modules().items():  # model/ itself, only its imports made flat
        flat = (out / f"{flat_name(module)}.py").read_text()
        for other in sorted(model_modules(), key=len, reverse=True):
            flat = flat.replace(f"from .{flat_name(other)} import", f"from {other} import")
        flat = re.sub(r"""(custom_op\(\s*["'])pelab_[0-9a-f]{12}::""", r"\1pelab::", flat)
        assert flat == path.read_text(), module
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["PelabForCausalLM"]
    assert config["pe"] == {"scheme": "t5", "options": {"num_buckets": 8, "max_distance": 20}, "scaling": None}
    assert config["gpt"]["norm"] == "rmsnorm" and config["gpt"]["n_layer"] == 2 and config["gpt"]["attention"] == "auto"
    assert (out / REGISTRY).is_file()
    assert json.loads((out / "generation_config.json").read_text()).get("use_cache", True) is True


def test_loading_an_export_leaves_pelabs_own_operators_in_place(exported, monkeypatch):
    """The folder's copy of model/ registers its torch operators under its own namespace: loaded in
    a process that trains pelab models, it does not replace pelab's kernels (it did: a second
    ``pelab::attention_with_bias_grad`` took over the name, and pelab's learned-bias backward ran the
    folder's copy of the code)."""
    from model.attention import bias_grad

    gpt, out = exported["kerple_power_swiglu"]
    shipped = (out / f"{flat_name('model.attention.bias_grad')}.py").read_text()
    assert '"pelab::' not in shipped and re.search(r'custom_op\("pelab_[0-9a-f]{12}::attention_with_bias_grad"', shipped)
    load(out)  # registers the folder's operators
    calls = []
    original = bias_grad._backward
    monkeypatch.setattr(bias_grad, "_backward", lambda *a: calls.append(1) or original(*a))
    gpt.train().zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    gpt(ids[:, :-1], targets=ids[:, 1:])[1].backward()
    gpt.eval()
    assert len(calls) == 2  # pelab's own backward, once a layer


def test_remote_code_imports_only_torch_the_standard_library_transformers_and_its_own_files(exported):
    _, out = exported["cope_clamped_window_gqa"]
    shipped = {path.stem for path in out.glob("*.py")}
    for path in out.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        wrapper = {"transformers"} if path.name in TEMPLATES else set()
        assert imported <= {"torch", *wrapper} | set(sys.stdlib_module_names), (path.name, imported)
        assert relative <= shipped, (path.name, relative - shipped)


def test_installed_pelab_ships_the_templates():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "pelab.hf_remote" in setuptools["packages"]


def test_an_option_the_scheme_does_not_take_is_refused_naming_it(tmp_path):
    gpt, pe = build("rope", {"keep_fraction": 0.5}, dict(window=8))
    with pytest.raises(ExportError, match=r"^pe.new_option=3 is not exportable as remote code: pe=rope takes base, "):
        export_model(gpt, tmp_path / "hf", pe_config={**pe, "new_option": 3})
    with pytest.raises(ExportError, match=r"^pe=rope built from the pe options \{\} computes other logits"):
        export_model(gpt, tmp_path / "hf", pe_config={})  # its keep_fraction unsaid
    gpt, _ = build("t5", {"num_buckets": 8}, {})
    with pytest.raises(ExportError, match=r"^pe=t5 built from the pe options \{\} does not take this model's weights: "
                                          r"Error\(s\) in loading state_dict"):
        export_model(gpt, tmp_path / "hf", pe_config={})  # 32 buckets by default
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# a scheme written outside the project: its file, registered by import, nothing else edited

THROWAWAY = '''"""A throwaway bias scheme: a learned per-head slope times log(1 + distance)."""

import torch
from torch import nn

from model.pe.base import PositionEncoding, relative_distance


class ThrowawayBias(PositionEncoding, name="test_throwaway_bias"):
    def __init__(self, config, init: float = 0.5) -> None:
        super().__init__(config)
        self.slopes = nn.Parameter(torch.full((config.n_head,), init))

    def bias(self, q_positions, k_positions):
        distance = relative_distance(q_positions, k_positions).clamp(min=0)
        return -self.slopes[:, None, None] * torch.log1p(distance).unsqueeze(-3)
'''


@pytest.fixture
def user_scheme(tmp_path, monkeypatch):
    """Writes a scheme module (name -> source) where Python finds it; unregisters its schemes after."""
    names = []

    def write(module: str, source: str) -> str:
        (tmp_path / f"{module}.py").write_text(source)
        names.append(module)
        return f"{module}.{source.split('class ')[1].split('(')[0]}"

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name, cls in list(SCHEMES.items()):  # SCHEMES is global: leave it as it was
        if cls.__module__ in names:
            del SCHEMES[name]
    for module in names:
        sys.modules.pop(module, None)


def test_a_scheme_defined_here_trains_samples_and_exports_with_no_other_edit(user_scheme, tmp_path):
    pe = {"_target_": user_scheme("pelab_throwaway_scheme", THROWAWAY), "init": 0.3}
    torch.manual_seed(0)
    gpt = LitGPT(model=dict(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=64), pe=pe).model
    assert gpt.pe.name == "test_throwaway_bias" and SCHEMES["test_throwaway_bias"] is type(gpt.pe)
    ids = torch.randint(0, VOCAB, (4, LENGTH + 1), generator=torch.Generator().manual_seed(7))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = gpt(ids[:, :-1], targets=ids[:, 1:])[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and not torch.allclose(gpt.pe.slopes, torch.full((4,), 0.3))
    gpt.eval()
    prompt = ids[:1, :PROMPT]
    text = gpt.generate(prompt, NEW, temperature=0)
    assert text.tolist() == gpt.generate(prompt, NEW, temperature=0, cache=False).tolist()

    out = export_model(gpt, tmp_path / "hf", pe_config=pe).path
    assert (out / f"{flat_name('pelab_throwaway_scheme')}.py").is_file()
    hf = load(out)
    with torch.no_grad():
        assert (hf(ids).logits - gpt(ids)[0]).abs().max().item() <= 1e-4
    assert greedy(hf, prompt).tolist() == text.tolist()


def test_a_scheme_module_importing_another_library_is_refused_naming_it(user_scheme, tmp_path):
    source = THROWAWAY.replace("import torch\n", "import numpy\nimport torch\n").replace(
        "test_throwaway_bias", "test_throwaway_numpy").replace("ThrowawayBias", "ThrowawayNumpy")
    pe = {"_target_": user_scheme("pelab_throwaway_numpy", source)}
    gpt = LitGPT(model=dict(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=64), pe=pe).model
    with pytest.raises(ExportError, match=r"pelab_throwaway_numpy.py line 3 imports numpy: is not exportable as "
                                          r"remote code \(a shipped module may import only torch, the standard "
                                          r"library and model/\)$"):
        export_model(gpt, tmp_path / "hf", pe_config=pe)
    assert not (tmp_path / "hf").exists()
