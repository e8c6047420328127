"""scripts/export_hf.py and pelab/export.py: a checkpoint exported to a native transformers class
computes pelab's logits (float32, max abs diff <= 1e-4) and pelab's greedy text, loads through
the Auto classes with its tokenizer; what no native class holds exactly is named and goes to remote
code (tests/scripts/test_export_remote.py), and what that cannot hold is refused before anything is
written. The references are pelab's own model and tokenizers run on the same inputs."""

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import lightning
import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from data.tokenizers import get_tokenizer  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.pe import SCHEMES  # noqa: E402
from model.pe.scaling import apply_scaling  # noqa: E402
from pelab.export import unexportable  # noqa: E402
from pelab.hf_classes import EXPORTERS  # noqa: E402
from pelab.hf_remote import SHIPPABLE, remote_refusal  # noqa: E402
from pelab.lit import LitGPT  # noqa: E402
from tests.tiny import tiny_gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Hello, wörld!\n  naïve café — 😀 日本語\n\tIt's 1234 don't\r\n\nend  "

LLAMA = dict(norm="rmsnorm", mlp="swiglu")  # conf/model/llama_tiny.yaml's block, without QK-norm

# name: (pe scheme, its options, model options, tokenizer)
CASES = {
    "learned": ("learned", {}, dict(bias=True), "bytes"),
    "rope": ("rope", {"base": 500.0}, dict(bias=False), "bytes"),
    "rope_half": ("rope", {"base": 2000.0, "rotary_fraction": 0.5}, dict(bias=True, pad_vocab_multiple=64), "gpt2"),
    "rope_linear": ("rope", {"scaling": {"kind": "linear", "factor": 2.0}}, {}, "bytes"),
    "rope_llama3": ("rope", {"base": 50.0, "scaling": {"kind": "llama3", "factor": 4.0, "original_length": 32,
                                                       "low_freq_factor": 1.5, "high_freq_factor": 6.0}}, {}, "bytes"),
    "llama": ("rope", {"base": 500.0}, dict(**LLAMA, n_kv_head=2, bias=False), "bytes"),
    "llama_mqa": ("rope", {"base": 50.0, "scaling": {"kind": "llama3", "factor": 4.0, "original_length": 32,
                                                     "low_freq_factor": 1.5, "high_freq_factor": 6.0}},
                  dict(**LLAMA, n_kv_head=1, bias=True, pad_vocab_multiple=64), "gpt2"),
}
ARCHITECTURE = {"learned": "GPT2LMHeadModel",
                **{name: "GPTNeoXForCausalLM" for name in CASES if name.startswith("rope")},
                "llama": "LlamaForCausalLM", "llama_mqa": "LlamaForCausalLM"}


def target(scheme: str) -> str:
    cls = SCHEMES[scheme]
    return f"{cls.__module__}.{cls.__qualname__}"


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights far from GPT-2's small init (and non-zero biases), so that logits are spread,
    greedy picks are clear and a misplaced weight shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.add_(noise * 0.1) if p.dim() == 1 else p.copy_(noise / math.sqrt(p.shape[-1]))


def write_checkpoint(folder: Path, scheme: str, pe_options: dict, model_options: dict, tokenizer: str) -> Path:
    """A train.py-like checkpoint (LitGPT hyper-parameters and weights) with config.yaml beside it."""
    torch.manual_seed(0)
    vocab = get_tokenizer(tokenizer).vocab_size
    model = dict(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=32, **model_options)
    lit = LitGPT(model=model, pe={"_target_": target(scheme), **pe_options})
    spread_weights(lit.model, seed=1)
    folder.mkdir(parents=True)
    ckpt = folder / "last.ckpt"
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams),
                "pytorch-lightning_version": lightning.__version__}, ckpt)
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": tokenizer}}))
    return ckpt


def script():
    spec = importlib.util.spec_from_file_location("pelab_script_export_hf", ROOT / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (checkpoint, exported folder), each written once through the script."""
    root = tmp_path_factory.mktemp("export")
    folders = {}
    for name, (scheme, pe_options, model_options, tokenizer) in CASES.items():
        ckpt = write_checkpoint(root / name / "checkpoints", scheme, pe_options, model_options, tokenizer)
        out = root / name / "hf"
        assert script().main([f"ckpt={ckpt}", f"out={out}"]) == 0
        folders[name] = (ckpt, out)
    return folders


@pytest.mark.parametrize("name", CASES)
def test_exported_model_gives_pelab_logits_and_greedy_text(exported, name):
    from pelab.checkpoint import load_lit_gpt

    ckpt, out = exported[name]
    gpt = load_lit_gpt(ckpt).model.eval()
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == ARCHITECTURE[name]
    ids = torch.randint(0, gpt.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = gpt(ids)[0], hf(ids).logits
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    assert want.std() > 0.5  # spread logits: the comparison is not of near-constants

    prompt = ids[:1, :8]
    hf.generation_config.eos_token_id = None  # pelab's greedy text runs all 50 tokens
    text = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=50)
    assert text.tolist() == gpt.generate(prompt, 50, temperature=0).tolist()


@pytest.mark.parametrize("name", CASES)
def test_tied_embeddings_are_stored_once_and_tied_on_load(exported, name):
    from safetensors import safe_open

    _, out = exported[name]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any("lm_head" in key or "embed_out" in key for key in f.keys())
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.get_output_embeddings().weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert hf.get_input_embeddings().weight.shape[0] == get_tokenizer(CASES[name][3]).vocab_size  # no padded rows
    assert (out / "generation_config.json").is_file()


def test_rope_settings_read_back_in_both_spellings(exported):
    _, out = exported["rope_half"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_parameters"]["rope_theta"] == saved["rope_theta"] == saved["rotary_emb_base"] == 2000.0
    assert saved["rope_parameters"]["partial_rotary_factor"] == saved["rotary_pct"] == 0.5
    assert saved["rope_scaling"] is None and saved["use_parallel_residual"] is False
    config = AutoConfig.from_pretrained(out)
    rope = getattr(config, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(config, "rotary_emb_base", None)) == 2000.0
    assert rope.get("partial_rotary_factor", getattr(config, "rotary_pct", None)) == 0.5


def test_rope_scaling_reads_back_in_both_spellings(exported):
    _, out = exported["rope_llama3"]
    saved = json.loads((out / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.5, "high_freq_factor": 6.0,
              "original_max_position_embeddings": 32}
    assert saved["rope_parameters"] == {**llama3, "rope_theta": 50.0, "partial_rotary_factor": 1.0}
    assert saved["rope_scaling"] == {**llama3, "type": "llama3"}
    assert AutoConfig.from_pretrained(out).rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("name", ["learned", "rope_half"])  # bytes and gpt2
def test_tokenizer_gives_pelab_ids(exported, name):
    _, out = exported[name]
    pelab_tokenizer = get_tokenizer(CASES[name][3])
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    ids = hf_tokenizer(TEXT)["input_ids"]
    assert ids == pelab_tokenizer.encode(TEXT)
    assert hf_tokenizer.decode(ids) == TEXT


def native_refusal(gpt, pe_config=None) -> str:
    """Why ``gpt`` has no native class; the remote code takes it (tests/scripts/test_export_remote.py)."""
    reason = unexportable(gpt, pe_config or {})
    assert reason is not None and remote_refusal(gpt, pe_config or {}) is None
    return reason


@pytest.mark.parametrize("scheme", sorted(set(SCHEMES) - {e.scheme for e in EXPORTERS.values()}))
def test_every_other_scheme_has_no_native_class(scheme):
    assert native_refusal(tiny_gpt(scheme)).startswith(
        f"pe={scheme} is not exportable to a native transformers class yet")


def scaled_rope():
    gpt = tiny_gpt("rope")
    apply_scaling(gpt.pe, {"kind": "yarn", "factor": 2.0}, gpt.config.block_size)
    return gpt


@pytest.mark.parametrize("build, pe_config, message", [
    (lambda: tiny_gpt("rope", pe_options={"keep_fraction": 0.5}), {}, "pe.keep_fraction=0.5 (p-RoPE)"),
    (lambda: tiny_gpt("rope", pe_options={"max_period": 64}), {}, "pe.max_period=64 (HoPE)"),
    (lambda: tiny_gpt("rope", pe_options={"learnable_freq": True}), {}, "pe.learnable_freq=true"),
    (scaled_rope, {}, "pe.scaling kind yarn"),
])
def test_inexact_options_have_no_native_class_naming_them(build, pe_config, message):
    reason = native_refusal(build(), pe_config)
    assert "not exportable" in reason and reason.startswith(message)


@pytest.mark.parametrize("scheme, pe_config", [("rope", {"randomize_to": 64}),
                                               ("learned", {"nope_every": None, "randomize_to": 32})])
def test_randomized_training_positions_keep_the_native_class(scheme, pe_config):
    # evaluation and generation run at 0..T-1 whatever positions training drew
    assert unexportable(tiny_gpt(scheme), pe_config) is None


# a non-default value of each model option no exporter maps (those this GPTConfig has)
MODEL_OPTIONS = {"attn_temperature": "log_length", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "n_kv_head": 2,
                 "window": 8, "window_pattern": [8, None]}


@pytest.mark.parametrize("key", [k for k in MODEL_OPTIONS if k in GPTConfig.__dataclass_fields__])
def test_non_default_model_options_have_no_native_class(key):
    value = MODEL_OPTIONS[key]
    assert re.match(re.escape(f"model.{key}={value!r} is not exportable"),
                    native_refusal(tiny_gpt("rope", **{key: value})))


@pytest.mark.parametrize("options, pe_options, message", [
    (dict(qk_norm=True), {}, "model.qk_norm=true is not exportable: transformers' LlamaForCausalLM has no QK-norm"),
    ({}, {"rotary_fraction": 0.5},
     "pe.rotary_fraction=0.5 with the Llama block: LlamaForCausalLM rotates the whole head"),
])
def test_the_llama_block_names_what_llama_lacks(options, pe_options, message):
    assert native_refusal(tiny_gpt("rope", pe_options=pe_options, **LLAMA, **options)).startswith(message)


def test_nope_layers_have_no_native_class():
    from model.gpt import GPT
    from tests.tiny import tiny_config

    config = tiny_config()
    gpt = GPT(config, SCHEMES["rope"](config), nope_layers=frozenset({1}))
    assert re.match(r"NoPE layers \[1\] \(pe.nope_every\) is not exportable", native_refusal(gpt))


def test_script_refuses_a_non_empty_out_before_the_checkpoint_is_read(tmp_path, monkeypatch):
    import pelab.checkpoint

    monkeypatch.setattr(pelab.checkpoint, "read_checkpoint", lambda *a, **k: pytest.fail("checkpoint read"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"out=.* is a non-empty directory; set overwrite=true to replace it"):
        script().main([f"ckpt={tmp_path / 'x.ckpt'}", f"out={tmp_path / 'out'}"])
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_script_refuses_a_missing_checkpoint_and_a_missing_out(tmp_path):
    with pytest.raises(SystemExit, match=r"ckpt=.*missing.ckpt does not exist"):
        script().main([f"ckpt={tmp_path / 'missing.ckpt'}", f"out={tmp_path / 'hf'}"])
    with pytest.raises(SystemExit, match="out=DIR is required"):
        script().main([f"ckpt={tmp_path / 'missing.ckpt'}"])
    assert list(tmp_path.iterdir()) == []


def test_script_refuses_an_unexportable_checkpoint_and_writes_nothing(tmp_path, monkeypatch):
    import pelab.hf_remote

    ckpt = write_checkpoint(tmp_path / "run", "alibi", {}, {}, "bytes")
    monkeypatch.setattr(pelab.hf_remote, "SHIPPABLE", SHIPPABLE - {"torch"})  # a model whose code cannot travel
    with pytest.raises(SystemExit, match=r"line \d+ imports torch: is not exportable as remote code"):
        script().main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    assert not (tmp_path / "hf").exists()


def test_script_writes_remote_code_with_the_tokenizer_and_says_how_to_load_it(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "run", "alibi", {}, {}, "bytes")
    assert script().main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"]) == 0
    printed = capsys.readouterr()
    assert "(PelabForCausalLM)" in printed.out
    assert "pe=alibi is not exportable to a native transformers class yet" in printed.err
    assert "trust_remote_code=True" in printed.err
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT)["input_ids"] == get_tokenizer("bytes").encode(TEXT)


def test_script_help_lists_its_options(capsys):
    assert script().main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert all(key in printed for key in ("ckpt=", "out=", "overwrite"))


def test_overwrite_replaces_the_folder_whole_and_a_failed_export_keeps_the_old_one(exported, tmp_path, monkeypatch):
    import pelab.export

    ckpt, _ = exported["learned"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pelab.export, "save_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        script().main([f"ckpt={ckpt}", f"out={out}", "overwrite=true"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "stale.txt").is_file()
    monkeypatch.undo()

    assert script().main([f"ckpt={ckpt}", f"out={out}", "overwrite=true"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def train_run(folder: Path) -> Path:
    """A run dir as train.py leaves it: .hydra/, checkpoints/last.ckpt + config.yaml, a log."""
    ckpt = write_checkpoint(folder / "checkpoints", "learned", {}, dict(bias=True), "bytes")
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (folder / "train.log").write_text("step 1\n")
    return ckpt


@pytest.mark.parametrize("where,message", [
    ("run", "contains the checkpoint ckpt="),
    ("run/checkpoints", "contains the checkpoint ckpt="),
    ("run/checkpoints/last.ckpt", "is the checkpoint ckpt="),
])
def test_an_out_holding_the_checkpoint_it_reads_is_refused_before_anything_is_read(tmp_path, monkeypatch, where,
                                                                                   message):
    """``out=RUN overwrite=true`` used to replace the whole run folder, checkpoints included."""
    import pelab.checkpoint

    ckpt = train_run(tmp_path / "run")
    before = tree_bytes(tmp_path)
    monkeypatch.setattr(pelab.checkpoint, "read_checkpoint", lambda *a, **k: pytest.fail("checkpoint read"))
    out = tmp_path / where
    with pytest.raises(SystemExit) as exit_:
        script().main([f"ckpt={ckpt}", f"out={out}", "overwrite=true"])
    assert str(exit_.value.code) == (f"out={out} {message}{ckpt} reads, which overwrite would delete; give out= a new "
                                     f"folder that holds no checkpoint, e.g. out={tmp_path / 'run' / 'hf'}")
    assert tree_bytes(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def sharded_dir(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "meta.pt").write_bytes(b"m")
    (folder / ".metadata").write_bytes(b"d")


@pytest.mark.parametrize("build,held", [
    (lambda out: train_run(out), ".hydra"),  # another run's folder
    (lambda out: (out / "a" / "checkpoints").mkdir(parents=True) or (out / "a" / "checkpoints" / "s.ckpt").write_text("x"),
     "a/checkpoints/s.ckpt"),  # a folder of runs
    (lambda out: sharded_dir(out / "checkpoints" / "step4"), "checkpoints/step4"),  # a sharded checkpoint, any name
])
def test_an_out_holding_any_runs_checkpoints_is_refused_with_or_without_overwrite(exported, tmp_path, build, held):
    ckpt, _ = exported["learned"]
    out = tmp_path / "other"
    out.mkdir()
    build(out)
    before = tree_bytes(out)
    for overwrite in ("true", "false"):
        with pytest.raises(SystemExit) as exit_:
            script().main([f"ckpt={ckpt}", f"out={out}", f"overwrite={overwrite}"])
        assert str(exit_.value.code) == (f"out={out} holds a training run's files ({out / held}), which overwrite "
                                         f"would delete; give out= a new folder, or a previous export's folder, "
                                         f"e.g. out={out / 'hf'}")
    assert tree_bytes(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_an_export_clears_the_temp_folders_of_killed_exports_to_the_same_out_only(exported, tmp_path):
    import subprocess

    ckpt, _ = exported["learned"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has ended
    stale = tmp_path / f".hf.{dead}-0123abcd.tmp"
    kept = [tmp_path / f".hf.{os.getpid()}-0123abcd.tmp",  # a live export's (this process)
            tmp_path / f".hf2.{dead}-0123abcd.tmp",  # another out's
            tmp_path / ".hf.0123abcd.tmp",  # not the pattern (no owner to ask)
            tmp_path / f".hf.{dead}-0123abcd.tmp.keep"]
    for folder in (stale, *kept):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    assert script().main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"]) == 0
    assert not stale.exists() and all(folder.is_dir() for folder in kept)
    assert (tmp_path / "hf" / "config.json").is_file()
