"""Refusals that used to come after the compute (issue 51, item 3) come before any data is read.

- A named attention backend is asked, at validation, with the request a training step makes
  (``pelab.validate.check_attention``): flex with CoPE's terms of the scores, flex training on a
  CPU. The reference is the real training step of a tiny model: validation refuses a run exactly
  when that step fails.
- ``eval.streaming``'s window is checked by the probe's own ``StreamingConfig.window_of``, from
  train.py's validation and from scripts/evaluate.py before the checkpoint is read.
- A probe asked for by name that cannot run on the data (a text probe on a synthetic task) says
  so in one line instead of being skipped silently.
"""

import pytest
import torch

from model.attention import AttentionRequest, resolve
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from tests.harness.test_config_errors import compose_config, no_work, refused  # noqa: F401 - a fixture
from tests.harness.test_script_errors import compose_evaluate, no_checkpoint_read, old_run, script  # noqa: F401

FLEX_CPU = ("model.attention=flex has no backward on cpu (FlexAttention trains on CUDA only); use "
            "model.attention=auto, sdpa or math to train there")
COPE_FLEX = "model.attention=flex cannot add pe=cope's terms of the attention scores; use model.attention=auto or math"
SINKS = ("eval.streaming.sinks must be less than the training length 256 when eval.streaming.window is null (the "
         "window is the training length minus the sinks, and none would be left); lower it or set "
         "eval.streaming.window, got 256")


def training_step_error(scheme: str, attention: str) -> str | None:
    """The error of one CPU training step (forward and backward) of a tiny model, or None."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, attention=attention)
    model = GPT(cfg, SCHEMES[scheme](cfg)).train()
    idx = torch.randint(0, 32, (2, 16))
    try:
        _, loss = model(idx, idx)
        loss.backward()
    except (ValueError, NotImplementedError, RuntimeError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("scheme", ["rope", "alibi", "cope"])
def test_validation_refuses_flex_on_cpu_exactly_when_a_training_step_fails(scheme, tmp_path, no_work):
    """The reference is torch itself: CPU flex has no backward, and flex cannot add CoPE's terms.
    On a machine without CUDA, trainer.accelerator=auto is the CPU."""
    step = training_step_error(scheme, "flex")
    assert step is not None  # every one of them fails on a CPU: the run must not start
    assert training_step_error(scheme, "auto") is None  # the way out the message gives trains
    message = refused([f"pe={scheme}", "model.attention=flex", "trainer.accelerator=cpu"], tmp_path)
    assert message == (COPE_FLEX if scheme == "cope" else FLEX_CPU)
    assert "\n" not in message


def test_auto_accelerator_is_the_cpu_without_cuda(tmp_path, no_work, monkeypatch):
    from pelab.validate import training_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert training_device("auto") == torch.device("cpu")
    assert training_device("gpu") == torch.device("cuda")
    assert refused(["model.attention=flex"], tmp_path) == FLEX_CPU


def test_flex_stays_allowed_where_it_works(tmp_path, no_work, monkeypatch):
    """CUDA training (auto on a machine with CUDA, or gpu), and CPU evaluation (no autograd),
    where flex's forward runs; CoPE stays refused on CUDA, by the same refusal."""
    assert refused(["model.attention=flex", "trainer.accelerator=gpu"], tmp_path) is None
    assert refused(["pe=cope", "model.attention=flex", "trainer.accelerator=gpu"], tmp_path) == COPE_FLEX
    with monkeypatch.context() as patch:  # trainer.accelerator=auto on a machine with CUDA
        patch.setattr(torch.cuda, "is_available", lambda: True)
        assert refused(["model.attention=flex", "pe=t5"], tmp_path) is None
    pe = SCHEMES["t5"](GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    assert resolve("flex", AttentionRequest(pe, torch.device("cpu"), grad=False)).name == "flex"
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, attention="flex")
    model = GPT(cfg, SCHEMES["t5"](cfg)).eval()
    idx = torch.randint(0, 32, (2, 16))
    with torch.no_grad():  # CPU evaluation on flex runs, and matches math
        got = model(idx, idx)[1]
        model.config.attention = "math"
        assert torch.allclose(got, model(idx, idx)[1], atol=1e-5)


def test_streaming_sinks_filling_the_context_are_refused_as_the_probe_would(tmp_path, no_work):
    """The message validation prints is the probe's own (``window_of``, which the probe calls)."""
    from evaluation.streaming import StreamingConfig

    with pytest.raises(ValueError) as err:
        StreamingConfig(sinks=256).window_of(256)
    assert str(err.value) == SINKS
    assert refused(["eval.streaming.enabled=true", "eval.streaming.sinks=256"], tmp_path) == SINKS
    assert refused(["eval.streaming.enabled=true", "eval.streaming.sinks=255"], tmp_path) is None  # W = 1
    assert refused(["eval.streaming.enabled=true", "eval.streaming.sinks=300", "eval.streaming.window=8"],
                   tmp_path) is None  # an explicit window: the cache holds S + W


def test_evaluate_script_refuses_streaming_sinks_before_the_checkpoint_is_read(old_run, no_checkpoint_read):
    overrides = [f"ckpt={old_run}", "eval.streaming.enabled=true", "eval.streaming.sinks=256"]
    with pytest.raises(SystemExit) as exit_:
        script("evaluate").evaluate(compose_evaluate(*overrides), overrides)
    assert str(exit_.value.code) == SINKS


def test_a_text_probe_asked_of_a_synthetic_run_says_it_is_skipped(tmp_path, capsys):
    synthetic = ["data=synthetic", "data.task=flipflop", "eval.extrapolation.enabled=false"]
    assert refused(synthetic + ["eval.streaming.enabled=true"], tmp_path) is None
    said = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert said == ["[pelab] eval.streaming.enabled=true is skipped: it scores held-out text and this run's data "
                    "(a synthetic task) has none; eval.tasks scores a synthetic run"]
    assert refused(synthetic, tmp_path) is None  # not asked: nothing said
    assert not [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
