"""``init_from=hf:DIR``: a run that starts from a Hugging Face transformers folder. pelab -> HF ->
pelab gives back every parameter tensor bit for bit (GPT-2, GPT-NeoX, Llama); a folder of another
model, position setting or vocabulary is refused in one line before any data is read; another
scheme starts fresh, saying so; a 2-step fine-tune from a folder runs through train.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from pelab.checkpoint import CheckpointError, load_init_weights  # noqa: E402
from pelab.export import export_model  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402
from pelab.validate import validate_config  # noqa: E402
from tests.harness.test_train import TINY_RUN, compose_config, run_train  # noqa: E402

SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.block_size=32", "data.tokenizer=bytes"]
VOCAB = 256  # bytes
LLAMA = ["model=llama_tiny", "model.qk_norm=false"]

# name: the run's overrides (its model and scheme, exported and imported with the same ones)
CASES = {
    "learned": ["pe=learned", "model.bias=true"],
    "rope": ["pe.base=500", "pe.rotary_fraction=0.5"],  # GPT-NeoX, its zero biases dropped on the way back
    "llama": [*LLAMA, "pe.base=500", "model.n_kv_head=2"],
    "llama_bias_padded": [*LLAMA, "model.n_kv_head=1", "model.bias=true", "model.pad_vocab_multiple=96"],
    # pelab's own remote code (PelabForCausalLM): GPT's weights under their names
    "remote": ["pe=alibi", "model.window_pattern=[8,null]", "model.sinks=learned", "model.n_kv_head=2",
               "model.qk_norm=true", "model.pad_vocab_multiple=96"],
}


def trained_like(overrides, seed=0) -> LitGPT:
    """A run's model with weights far from their init (biases too), as training leaves them."""
    cfg = compose_config([*SMALL, *overrides])
    torch.manual_seed(seed)
    lit = LitGPT(model={**OmegaConf.to_container(cfg.model), "vocab_size": VOCAB}, pe=OmegaConf.to_container(cfg.pe))
    with torch.no_grad():
        for p in lit.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return lit


def export(tmp_path, overrides, name="hf"):
    lit = trained_like(overrides)
    export_model(lit.model, tmp_path / name, pe_config=dict(lit.hparams["pe"]))
    return lit.model, tmp_path / name


def imported(folder, overrides, vocab=VOCAB) -> tuple[GPT, GPT]:
    """(the run's model as built, the same after init_from=hf:folder), as train.py does it."""
    cfg = compose_config([*SMALL, *overrides, f"init_from=hf:{folder}"])
    checked = validate_config(cfg)
    gpt = GPT(GPTConfig(vocab_size=vocab, **OmegaConf.to_container(cfg.model)), checked.position.scheme)
    fresh = {k: v.clone() for k, v in gpt.state_dict().items()}
    load_init_weights(gpt, checked.init_state, cfg.init_from)
    return fresh, gpt


@pytest.mark.parametrize("name", CASES)
def test_round_trip_gives_every_parameter_back_bit_for_bit(tmp_path, name):
    source, folder = export(tmp_path, CASES[name])
    fresh, gpt = imported(folder, CASES[name])
    got, want = gpt.state_dict(), source.state_dict()
    assert got.keys() == want.keys()
    vocab = VOCAB if name in ("llama_bias_padded", "remote") else want["wte.weight"].shape[0]
    for key, value in want.items():
        if key in ("wte.weight", "lm_head.weight"):  # the folder keeps no padding rows: the run's own stay
            assert torch.equal(got[key][:vocab], value[:vocab]), key
            assert torch.equal(got[key][vocab:], fresh[key][vocab:]), key
        else:
            assert torch.equal(got[key], value), key
    if name in ("llama_bias_padded", "remote"):
        assert want["wte.weight"].shape[0] == 288  # 256 padded to 3 x 96
    assert gpt.lm_head.weight is gpt.wte.weight


def hf_written(folder, name):
    """A folder written by transformers itself (its own random init, spread out): not by the exporter."""
    import transformers

    common = dict(vocab_size=VOCAB, tie_word_embeddings=True, initializer_range=0.3, bos_token_id=None,
                  eos_token_id=None)
    config = {
        "GPT2LMHeadModel": transformers.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                   activation_function="gelu", **common),
        "GPTNeoXForCausalLM": transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, hidden_act="gelu",
            max_position_embeddings=32, use_parallel_residual=False, attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}, **common),
        "LlamaForCausalLM": transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=32, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **common),
    }[name]
    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms' weights near 1, biases near 0, as trained models have them
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if torch.all(p == 1) else 0.0))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name, overrides", [
    ("GPT2LMHeadModel", ["pe=learned", "model.bias=true"]),
    ("GPTNeoXForCausalLM", [*CASES["rope"], "model.bias=true"]),
    ("LlamaForCausalLM", CASES["llama"]),
])
def test_a_folder_transformers_wrote_gives_its_logits_in_pelab(tmp_path, name, overrides):
    hf = hf_written(tmp_path / "hf", name)
    _, gpt = imported(tmp_path / "hf", overrides)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, gpt.eval()(ids)[0]
    assert want.std() > 0.5  # spread logits: the comparison is not of near-constants
    assert (got - want).abs().max().item() <= 1e-4


def one_line_error(folder, overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        imported(folder, overrides)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_another_model_is_refused_naming_each_key(tmp_path):
    _, folder = export(tmp_path, CASES["llama"])
    msg = one_line_error(folder, [*LLAMA, "model.n_layer=3", "model.n_kv_head=4", "model.qk_norm=true"],
                         "holds another model")
    assert "the folder (LlamaForCausalLM) has model.n_layer=2, model.n_kv_head=2, model.qk_norm=False" in msg
    assert "this run has model.n_layer=3, model.n_kv_head=4, model.qk_norm=True" in msg
    one_line_error(folder, [], r"model.norm=rmsnorm, model.mlp=swiglu.* this run has .*model.norm=layernorm")


def test_another_vocabulary_is_refused_before_the_weights_load(tmp_path):
    _, folder = export(tmp_path, CASES["rope"])
    with pytest.raises(CheckpointError, match=r"has 256 token rows \(wte.weight\), this run's model 64 "
                                              r"\(model.vocab_size=64 from the data's tokenizer"):
        imported(folder, CASES["rope"], vocab=64)


def test_the_folders_position_settings_are_kept_or_refused(tmp_path):
    _, folder = export(tmp_path, CASES["rope"])
    msg = one_line_error(folder, ["pe.base=10000", "pe.rotary_fraction=1.0"], "was trained with")
    assert "pe.base=500.0, pe.rotary_fraction=0.5, this run has pe.base=10000, pe.rotary_fraction=1.0" in msg
    one_line_error(folder, [*CASES["rope"], "model.block_size=64"],
                   r"model.block_size=<= 32 .* this run has model.block_size=64")
    imported(folder, [*CASES["rope"], "model.block_size=64", "pe.scaling.kind=linear", "pe.scaling.factor=2"])
    _, table = export(tmp_path, CASES["learned"], "gpt2")
    one_line_error(table, ["pe=learned", "model.bias=true", "pe.max_positions=64"], r"pe.max_positions=32")


def test_another_scheme_starts_fresh_saying_so(tmp_path, capsys):
    source, folder = export(tmp_path, CASES["learned"])
    fresh, gpt = imported(folder, ["pe=t5", "model.bias=true"])
    printed = capsys.readouterr().out
    assert "its positions are pe=learned (GPT2LMHeadModel), this run's pe=t5: its position table is dropped" in printed
    for key, value in gpt.state_dict().items():
        assert torch.equal(value, fresh[key] if key.startswith("pe.") else source.state_dict()[key]), key


def test_non_zero_biases_need_model_bias(tmp_path):
    _, folder = export(tmp_path, CASES["learned"])
    one_line_error(folder, ["pe=learned", "model.bias=false"],
                   r"has a non-zero transformer.h.0.ln_1.bias and this run has model.bias=false; set model.bias=true")


def test_model_bias_fills_the_biases_a_folder_lacks_with_zeros(tmp_path):
    source, folder = export(tmp_path, CASES["rope"])  # GPT-NeoX without attention_bias
    _, gpt = imported(folder, [*CASES["rope"], "model.bias=true"])
    attn = gpt.blocks[0].attn
    assert torch.equal(attn.c_attn.bias, torch.zeros(96)) and torch.equal(attn.c_proj.bias, torch.zeros(32))
    assert torch.equal(gpt.blocks[0].ln_1.bias, torch.zeros(32))  # the folder's zero LayerNorm bias, read
    assert torch.equal(attn.c_attn.weight, source.blocks[0].attn.c_attn.weight)


def test_near_settings_are_printed_and_other_blocks_refused(tmp_path, capsys):
    _, folder = export(tmp_path, CASES["learned"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_new",
                                                    "layer_norm_epsilon": 1e-6}))
    imported(folder, CASES["learned"])
    printed = capsys.readouterr().out
    assert "activation_function=gelu_new (tanh GELU) computed with pelab's exact GELU" in printed
    assert "layer_norm_epsilon=1e-06 computed with pelab's 1e-05" in printed
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "relu", "n_inner": 64}))
    one_line_error(folder, CASES["learned"], r"\(GPT2LMHeadModel\) has n_inner=64 \(pelab's MLP is 4 x n_embd wide\); "
                                             r"activation_function='relu' \(pelab's MLP is GELU\)")


def test_bad_folders_are_refused_in_one_line(tmp_path):
    one_line_error(tmp_path / "missing", [], "is not a folder")
    _, folder = export(tmp_path, CASES["rope"])
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    one_line_error(folder, [],
                   "is a BertForMaskedLM; pelab imports GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM, "
                   "SmolLM3ForCausalLM, PelabForCausalLM$")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    one_line_error(folder, [], r"has no weights \(\*.safetensors or pytorch_model\*.bin\)")
    (folder / "config.json").unlink()
    one_line_error(folder, [], "has no config.json")


def test_a_remote_code_folder_is_read_as_a_pelab_checkpoint(tmp_path, capsys):
    source, folder = export(tmp_path, CASES["remote"])
    msg = one_line_error(folder, [*CASES["remote"], "model.n_layer=3", "model.qk_norm=false"], "holds another model")
    assert "the folder (PelabForCausalLM) has model.n_layer=2, model.qk_norm=True, this run has model.n_layer=3, " \
           "model.qk_norm=False" in msg
    fresh, gpt = imported(folder, [*CASES["remote"], "pe=t5", "model.dropout=0.1"])  # INIT_FREE keys may change
    assert "its positions are pe=alibi (PelabForCausalLM), this run's pe=t5: the run's scheme starts" \
           in capsys.readouterr().out
    for key, value in gpt.state_dict().items():
        if key.startswith("pe."):
            assert torch.equal(value, fresh[key]), key
        elif key not in ("wte.weight", "lm_head.weight"):
            assert torch.equal(value, source.state_dict()[key]), key


def test_a_remote_code_folder_of_the_restated_model_is_refused_in_one_line(tmp_path):
    _, folder = export(tmp_path, CASES["remote"])
    config = json.loads((folder / "config.json").read_text())
    del config["pelab_format"]  # as the folders of pelab's earlier remote code (parts and kinds) have it
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(folder, CASES["remote"], r"is remote code of an older pelab export .* export the checkpoint again")


def test_without_transformers_the_import_names_the_install(tmp_path, monkeypatch):
    _, folder = export(tmp_path, CASES["rope"])
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as when not installed
    one_line_error(folder, CASES["rope"], r'needs transformers: pip install -e "\.\[dev\]"')


def test_a_fine_tune_from_a_folder_runs(tmp_path):
    _, folder = export(tmp_path, CASES["llama"])
    proc = run_train([*SMALL, *CASES["llama"], f"init_from=hf:{folder}", "logger=none",
                      f"hydra.run.dir={tmp_path / 'run'}",
                      "eval.probe.enabled=false", *[a for a in TINY_RUN if not a.startswith("model.")]], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[pelab] init_from: weights of hf:{folder}" in proc.stdout
    assert (tmp_path / "run" / "checkpoints").is_dir()
