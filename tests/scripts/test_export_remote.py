"""Remote-code export (pelab/hf_remote/): every registered scheme, and the options no native class
holds, written as modeling_pelab.py + configuration_pelab.py with ``auto_map``, loads with
``trust_remote_code=True`` and computes pelab's logits (float32, max abs diff <= 1e-4) and pelab's
greedy text (model/generate.py with its KV cache, temperature 0). The reference is pelab's own
model on the same weights and ids, its scheme parameters moved off their initialisation."""

import ast
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from model.pe import SCHEMES  # noqa: E402
from model.pe.schedule import SCHEDULE_KEYS  # noqa: E402
from pelab.export import ExportError, export_model  # noqa: E402
from pelab.hf_classes import EXPORTERS  # noqa: E402
from pelab.hf_remote import AUTO_MAP, REMOTE_SCHEMES, TEMPLATES  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VOCAB, LENGTH, PROMPT, NEW = 61, 32, 8, 24  # greedy text: 8 + 24 tokens, within the training length
PAIRS = 8  # rotary pairs of a 16-dim head
YARN = {"kind": "yarn", "factor": 2.0, "original_length": 16}
LLAMA3 = {"kind": "llama3", "factor": 4.0, "original_length": 16, "low_freq_factor": 1.5, "high_freq_factor": 6.0}
LONGROPE = {"kind": "longrope", "factor": 2.0, "short_factor": [1.0 + k / 8 for k in range(PAIRS)],
            "long_factor": [1.0 + k for k in range(PAIRS)]}

# name: (pe scheme, its options, model options); every registered scheme and each option no native class holds
CASES = {
    "learned_window_bias": ("learned", {}, dict(window=8, bias=True, pad_vocab_multiple=16)),
    "sinusoidal": ("sinusoidal", {}, {}),
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
    "kerple_log": ("kerple_log", {}, {}),
    "kerple_power_swiglu": ("kerple_power", {}, dict(mlp="swiglu")),
    "nope_llama4": ("nope", {}, dict(attn_temperature="llama4", attn_temperature_floor=4,
                                     attn_temperature_scale=0.5)),
    "t5_rmsnorm": ("t5", {"num_buckets": 8, "max_distance": 20}, dict(norm="rmsnorm")),
}
if "pope" in SCHEMES:
    CASES["pope"] = ("pope", {}, {})
if "fox" in SCHEMES:  # per-layer gates of the attention input; a window masks
    CASES["fox_window_gqa"] = ("fox", {}, dict(window_pattern=[8, None], n_kv_head=2))
if "cope" in SCHEMES:  # gates of the scores over the visible keys; a small table clamps the positions
    CASES["cope_clamped_window_gqa"] = ("cope", {"npos_max": 6}, dict(window_pattern=[8, None], n_kv_head=2))
# attention sinks (learned: gpt-oss's per-head logit; zero: off-by-one) and stick-breaking attention
CASES["t5_learned_sinks_pattern"] = ("t5", {"num_buckets": 8}, dict(sinks="learned", window_pattern=[8, None]))
CASES["alibi_zero_sinks_gqa"] = ("alibi", {}, dict(sinks="zero", n_kv_head=2))
CASES["rope_stick_breaking_window"] = ("rope", {}, dict(normaliser="stick_breaking", window=8))
if "global_base" in SCHEDULE_KEYS:  # per-layer RoPE bases (Gemma 3's local and global theta)
    CASES["rope_global_base"] = ("rope", {"base": 100.0, "global_base": 10000.0}, dict(window_pattern=[8, None]))


def target(scheme: str) -> str:
    cls = SCHEMES[scheme]
    return f"{cls.__module__}.{cls.__qualname__}"


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight off its init (the scheme's too: T5's table, KERPLE's r, FIRE's MLP, c and threshold,
    learned frequencies, ssmax's s_h), so logits are spread and a misplaced term shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(noise * 0.1) if p.dim() == 1 else p.copy_(noise / math.sqrt(p.shape[-1]))


def build(scheme: str, pe_options: dict, model_options: dict):
    """(pelab's GPT, its pe config), built as train.py builds a run."""
    torch.manual_seed(0)
    model = dict(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=64, **model_options)
    pe = {"_target_": target(scheme), **pe_options}
    gpt = LitGPT(model=model, pe=pe).model.eval()
    spread_weights(gpt, seed=1)
    return gpt, pe


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny matmuls: threads only wait on each other (40x slower on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (pelab's GPT, the folder it was exported to), each built and written once."""
    root = tmp_path_factory.mktemp("remote")
    models = {}
    for name, case in CASES.items():
        gpt, pe = build(*case)
        result = export_model(gpt, root / name, pe_config=pe)
        assert result.architecture == "PelabForCausalLM", result
        models[name] = (gpt, result.path)
    return models


def test_every_registered_scheme_exports_and_has_a_case():
    native = {e.scheme for e in EXPORTERS.values()}
    for name in SCHEMES:
        assert name in REMOTE_SCHEMES or name in native, (
            f"pe={name} has no export: add its entry to REMOTE_SCHEMES in pelab/hf_remote/__init__.py and its "
            f"formula to pelab/hf_remote/modeling_pelab.py")
    untested = sorted(set(SCHEMES) - {scheme for scheme, _, _ in CASES.values()})
    assert not untested, f"add a case for pe={untested[0]} to CASES in tests/scripts/test_export_remote.py"


@pytest.mark.parametrize("name", CASES)
def test_remote_code_gives_pelab_logits_and_greedy_text(exported, name):
    gpt, out = exported[name]
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "PelabForCausalLM"
    T = LENGTH if gpt.pe.max_positions else LENGTH + 8  # past the training length where the scheme can go
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = gpt(ids)[0], hf(ids).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std() > 0.5  # spread logits: the comparison is not of near-constants

    prompt = ids[:1, :PROMPT]
    text = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                       eos_token_id=None)
    assert text.tolist() == gpt.generate(prompt, NEW, temperature=0).tolist()


def test_left_padded_batch_generates_each_prompt_as_alone(exported):
    gpt, out = exported["alibi_linear_log_length"]
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    prompts = torch.randint(0, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(4))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompts[1:, 3:]), dim=1)
    batch = torch.cat((prompts[:1], padded))
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    text = hf.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert text[0].tolist() == gpt.generate(prompts[:1], 8, temperature=0)[0].tolist()
    assert text[1, 3:].tolist() == gpt.generate(prompts[1:, 3:], 8, temperature=0)[0].tolist()


def test_labels_give_pelab_next_token_loss(exported):
    gpt, out = exported["rope_alibi_ssmax"]
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert hf(ids, labels=ids).loss.item() == pytest.approx(gpt(ids[:, :-1], targets=ids[:, 1:])[1].item(),
                                                                abs=1e-5)


def test_folder_holds_the_templates_verbatim_and_auto_map(exported):
    _, out = exported["t5_rmsnorm"]
    for name in TEMPLATES:
        assert (out / name).read_bytes() == (ROOT / "pelab" / "hf_remote" / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["PelabForCausalLM"]
    assert config["pe"]["bias"] == {"kind": "t5", "num_buckets": 8, "max_distance": 20}
    assert json.loads((out / "generation_config.json").read_text())["use_cache"] is False


def test_remote_code_imports_only_torch_and_transformers():
    for name in TEMPLATES:
        tree = ast.parse((ROOT / "pelab" / "hf_remote" / name).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        relative = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        assert imported <= {"math", "torch", "transformers"}, (name, imported)
        assert relative <= {"configuration_pelab"}, (name, relative)


def test_remote_code_refuses_a_part_it_does_not_compute():
    from pelab.hf_remote.configuration_pelab import PelabConfig
    from pelab.hf_remote.modeling_pelab import PelabForCausalLM

    with pytest.raises(ValueError, match=r"config.json pe.bias.kind='newer' is not one of slopes, t5, "):
        PelabForCausalLM(PelabConfig(vocab_size=VOCAB, n_embd=32, pe={"bias": {"kind": "newer"}}))


def test_installed_pelab_ships_the_templates():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "pelab.hf_remote" in setuptools["packages"]


def test_a_scheme_without_an_entry_is_refused_naming_what_to_add(tmp_path, monkeypatch):
    gpt, pe = build("t5", {}, {})
    monkeypatch.delitem(REMOTE_SCHEMES, "t5")
    with pytest.raises(ExportError) as err:
        export_model(gpt, tmp_path / "hf", pe_config=pe)
    assert str(err.value).startswith("pe=t5 is not exportable (not even as remote code): add its entry to "
                                     "REMOTE_SCHEMES in pelab/hf_remote/__init__.py")
    assert list(tmp_path.iterdir()) == []


def test_an_option_the_remote_code_does_not_read_is_refused_naming_it(tmp_path, monkeypatch):
    import model.pe.schedule
    import pelab.hf_remote

    gpt, pe = build("rope", {"keep_fraction": 0.5}, dict(window=8))
    with pytest.raises(ExportError, match=r"^pe.new_option=3 is not exportable \(not even as remote code\)"):
        export_model(gpt, tmp_path / "hf", pe_config={**pe, "new_option": 3})
    monkeypatch.setattr(model.pe.schedule, "SCHEDULE_KEYS", (*SCHEDULE_KEYS, "new_layer_option"))
    with pytest.raises(ExportError, match=r"^pe.new_layer_option=1 is not exportable \(not even as remote code\)"):
        export_model(gpt, tmp_path / "hf", pe_config={**pe, "new_layer_option": 1})
    monkeypatch.setattr(pelab.hf_remote, "FIELDS", pelab.hf_remote.FIELDS - {"window"})
    with pytest.raises(ExportError, match=r"^model.window=8 is not exportable \(not even as remote code\): only its "
                                          r"default None is"):
        export_model(gpt, tmp_path / "hf", pe_config=pe)
    assert list(tmp_path.iterdir()) == []


def test_a_sink_kind_the_remote_code_does_not_compute_is_refused_naming_it(exported):
    from pelab.hf_remote.configuration_pelab import PelabConfig
    from pelab.hf_remote.modeling_pelab import PelabForCausalLM

    for key, value in (("sinks", "per_token"), ("normaliser", "sparsemax")):
        with pytest.raises(ValueError, match=rf"^config.json {key}='{value}' is not one of"):
            PelabForCausalLM(PelabConfig(**{key: value}))
