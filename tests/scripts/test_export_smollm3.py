"""Native export of per-layer positions (pelab/hf_classes.py's SmolLM3 entry): a rope model with
the Llama block and NoPE layers (pe.nope_layers, pe.nope_every) and/or sliding windows of one size
loads with transformers' own ``SmolLM3ForCausalLM`` (no remote code) and computes pelab's logits
(float32, max abs diff <= 1e-4) at a length past the window, and pelab's greedy text; a window one
key wider or narrower, or RoPE on the NoPE layer, would not. ``init_from=hf:DIR`` reads the folder
back to the same model and every weight bit for bit, and computes the logits of a SmolLM3 that
transformers itself initialised. What SmolLM3 cannot hold (two window sizes, per-layer RoPE bases,
temperatures) keeps its one-line reason and goes to remote code. References: pelab's own model and
transformers' own class, on the same weights and ids."""

import json
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, SmolLM3Config, SmolLM3ForCausalLM  # noqa: E402

from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from pelab.checkpoint import load_init_weights  # noqa: E402
from pelab.export import export_model, exporter_for, unexportable  # noqa: E402
from pelab.hf_classes import EXPORTERS  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402
from pelab.validate import validate_config  # noqa: E402
from tests.harness.test_init_from_hf import SMALL, VOCAB  # noqa: E402
from tests.harness.test_train import compose_config  # noqa: E402

W = 8  # the window; the logits are compared at LENGTH > W, so its off-by-one shows
LENGTH = 32
LLAMA = dict(norm="rmsnorm", mlp="swiglu")  # the Llama block, without QK-norm

# name: (pe options, model options, the run's overrides for the same model in train.py)
CASES = {
    "rnope_swa": ({"base": 500.0, "nope_layers": "global"}, dict(**LLAMA, n_kv_head=2, window_pattern=[W, None]),
                  ["model.window_pattern=[8,null]", "pe.nope_layers=global", "model.n_kv_head=2", "pe.base=500"]),
    "nope_every": ({"nope_every": 2}, dict(**LLAMA, n_kv_head=1, bias=True, pad_vocab_multiple=96),
                   ["pe.nope_every=2", "model.n_kv_head=1", "model.bias=true", "model.pad_vocab_multiple=96"]),
    "window": ({"base": 500.0}, dict(**LLAMA, n_kv_head=2, window=W),
               ["model.window=8", "model.n_kv_head=2", "pe.base=500"]),
}
PLAN = {  # the config.json each case writes: (no_rope_layers, layer_types, sliding_window)
    "rnope_swa": ([1, 0], ["sliding_attention", "full_attention"], W),
    "nope_every": ([1, 0], ["full_attention", "full_attention"], None),
    "window": ([1, 1], ["sliding_attention", "sliding_attention"], W),
}
RUN = ["model=llama_tiny", "model.qk_norm=false"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()  # tiny matmuls: threads only wait on each other on a loaded machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(pe_options: dict, model_options: dict, seed: int = 0):
    """(pelab's GPT with every weight off its init, its pe config), built as train.py builds a run."""
    torch.manual_seed(seed)
    pe = {"_target_": "model.pe.rope.RoPE", **pe_options}
    gpt = LitGPT(model=dict(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=32, **model_options),
                 pe=pe).model.eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in gpt.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(noise * 0.1) if p.dim() == 1 else p.copy_(noise / math.sqrt(p.shape[-1]))
    return gpt, pe


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (pelab's GPT, the folder it was exported to), each written once."""
    root = tmp_path_factory.mktemp("smollm3")
    folders = {}
    for name, (pe_options, model_options, _) in CASES.items():
        gpt, pe = build(pe_options, model_options)
        result = export_model(gpt, root / name, pe_config=pe)
        assert result.architecture == "SmolLM3ForCausalLM"
        folders[name] = (gpt, result.path)
    return folders


def load(folder, **config):
    return SmolLM3ForCausalLM.from_pretrained(folder, dtype=torch.float32, **config).eval()


def imported(folder, overrides) -> tuple[dict, GPT]:
    """(the run's weights as built, its model after init_from=hf:folder), as train.py builds it:
    its scheme with the run's NoPE layers."""
    from omegaconf import OmegaConf

    cfg = compose_config([*SMALL, *RUN, *overrides, f"init_from=hf:{folder}"])
    checked = validate_config(cfg)
    position = checked.position
    gpt = GPT(GPTConfig(vocab_size=VOCAB, **OmegaConf.to_container(cfg.model)), position.scheme,
              nope_layers=position.nope_layers, layer_rope=position.layer_rope)
    fresh = {k: v.clone() for k, v in gpt.state_dict().items()}
    load_init_weights(gpt, checked.init_state, cfg.init_from)
    return fresh, gpt


def one_line_error(folder, overrides, match) -> str:
    with pytest.raises(ValueError, match=match) as err:
        imported(folder, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


IDS = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))  # 48 > W


@pytest.mark.parametrize("name", CASES)
def test_smollm3_gives_pelab_logits_and_greedy_text(exported, name):
    gpt, folder = exported[name]
    assert not list(folder.glob("*.py"))  # transformers' own class: nothing to trust
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["SmolLM3ForCausalLM"]
    hf = load(folder)
    with torch.no_grad():
        want, got = gpt(IDS)[0], hf(IDS).logits
    assert want.std() > 0.5  # spread logits: the comparison is not of near-constants
    assert (got - want).abs().max().item() <= 1e-4

    prompt = IDS[:1, :8]  # 8 + 50 tokens: the cache runs past the window
    text = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=50,
                       eos_token_id=None)
    assert text.tolist() == gpt.generate(prompt, 50, temperature=0).tolist()


@pytest.mark.parametrize("name", CASES)
def test_config_holds_each_layers_rope_and_window(exported, name):
    _, folder = exported[name]
    config = json.loads((folder / "config.json").read_text())
    no_rope, types, window = PLAN[name]
    assert (config["no_rope_layers"], config["layer_types"], config["sliding_window"]) == (no_rope, types, window)
    assert config["use_sliding_window"] is (window is not None)
    assert config["rope_parameters"]["rope_theta"] == CASES[name][0].get("base", 10000.0)


@pytest.mark.parametrize("config", [dict(sliding_window=W - 1), dict(sliding_window=W + 1),
                                    dict(no_rope_layers=[1, 1])], ids=["window-1", "window+1", "rope-everywhere"])
def test_a_window_off_by_one_or_rope_on_the_nope_layer_shows(exported, config):
    # HF's sliding window W sees keys i-W+1..i (masking_utils: kv_idx > q_idx - W), as pelab's model.window
    gpt, folder = exported["rnope_swa"]
    with torch.no_grad():
        assert (load(folder, **config)(IDS).logits - gpt(IDS)[0]).abs().max().item() > 0.1


@pytest.mark.parametrize("name", CASES)
def test_init_from_reads_back_the_model_and_every_weight(exported, name):
    source, folder = exported[name]
    read = EXPORTERS["SmolLM3ForCausalLM"].read(AutoConfig.from_pretrained(folder))
    assert read.model["window_pattern"] == list(source.config.layer_windows) and not read.refusals
    assert read.nope_layers == tuple(sorted(source.nope_layers))
    fresh, gpt = imported(folder, CASES[name][2])
    assert gpt.config.layer_windows == source.config.layer_windows and gpt.nope_layers == source.nope_layers
    want, got = source.state_dict(), gpt.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key in ("wte.weight", "lm_head.weight"):  # the folder keeps no padding rows: the run's own stay
            assert torch.equal(got[key][:VOCAB], value[:VOCAB]) and torch.equal(got[key][VOCAB:], fresh[key][VOCAB:])
        else:
            assert torch.equal(got[key], value), key


def test_init_from_refuses_other_windows_nope_layers_or_bases_in_one_line(exported):
    _, folder = exported["rnope_swa"]
    same = CASES["rnope_swa"][2]
    msg = one_line_error(folder, [*same, "model.window_pattern=[4,null]"], "holds another model")
    assert "has model.window_pattern=[8, None], this run has model.window_pattern=[4, None]" in msg
    msg = one_line_error(folder, [*same, "pe.nope_layers=null"], "was trained with")
    assert "NoPE layers=[1], this run has NoPE layers=[] (pe.nope_every, pe.nope_layers)" in msg
    msg = one_line_error(folder, [*same, "pe.nope_layers=null", "pe.global_base=10000"], "was trained with")
    assert "pe.global_base=None, NoPE layers=[1], this run has pe.global_base=10000, NoPE layers=[]" in msg
    config = json.loads((folder / "config.json").read_text())  # windowed by the mask, not by flash attention
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    try:
        one_line_error(folder, same, r"\(SmolLM3ForCausalLM\) has layer_types with sliding_attention and "
                                     r"use_sliding_window=False, sliding_window=8 \(transformers' backends disagree")
    finally:
        (folder / "config.json").write_text(json.dumps(config))


def test_a_folder_transformers_wrote_gives_its_logits_in_pelab(tmp_path):
    config = SmolLM3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=LENGTH,
                           rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                           no_rope_layers=[1, 0], layer_types=["sliding_attention", "full_attention"],
                           use_sliding_window=True, sliding_window=W, initializer_range=0.3, pad_token_id=None,
                           bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:  # norms' weights near 1, as trained models have them
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    hf.save_pretrained(tmp_path)
    _, gpt = imported(tmp_path, CASES["rnope_swa"][2])
    ids = IDS[:, :LENGTH]
    with torch.no_grad():
        want, got = hf(ids).logits, gpt.eval()(ids)[0]
    assert want.std() > 0.5
    assert (got - want).abs().max().item() <= 1e-4


def test_the_llama_block_without_a_per_layer_plan_stays_llama():
    gpt, pe = build({"base": 500.0}, dict(**LLAMA, n_kv_head=2))
    assert unexportable(gpt, pe) is None and exporter_for(gpt, pe).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("pe_options, model_options, reason", [
    ({}, dict(**LLAMA, window_pattern=[W, 4]),  # one sliding_window in SmolLM3
     r"^model.window_pattern=\[8, 4\] is not exportable to a native transformers class yet "
     r"\(SmolLM3ForCausalLM has one sliding_window for all windowed layers; these have \[4, 8\]\)$"),
    ({"global_base": 10000.0}, dict(**LLAMA, window_pattern=[W, None]),  # one rope_parameters for every layer
     r"^pe.global_base=10000.0 is not exportable"),
    ({"nope_layers": "global"}, dict(**LLAMA, window_pattern=[W, None], attn_temperature="log_length",
                                     attn_temperature_layers="global"),
     r"^model.attn_temperature='log_length' is not exportable"),
    ({"nope_every": 2}, dict(qk_norm=True, **LLAMA),
     r"^model.qk_norm=true is not exportable: transformers' SmolLM3ForCausalLM has no QK-norm"),
    ({"nope_layers": "global"}, dict(window_pattern=[W, None]),  # GPT-NeoX's block: no class with per-layer plans
     r"^model.window_pattern=\[8, None\] is not exportable"),
])
def test_what_smollm3_cannot_hold_is_refused_and_goes_to_remote_code(tmp_path, pe_options, model_options, reason):
    gpt, pe = build(pe_options, model_options)
    reason_given = unexportable(gpt, pe)
    assert reason_given is not None and re.match(reason, reason_given), reason_given
    if "window_pattern=[8, 4]" in reason_given:
        result = export_model(gpt, tmp_path / "hf", pe_config=pe)
        assert result.architecture == "PelabForCausalLM" and result.notes[0].startswith(reason_given)
