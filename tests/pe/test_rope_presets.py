"""The high-frequency RoPE presets (conf/pe/hope.yaml, rope_half_truncated.yaml, rope_frayed.yaml),
composed as train.py composes them, against their sources' definitions written here in float64:

- HoPE (Chen et al. 2024, arXiv 2410.21216): RoPE's theta_i = 10000^(-2i/d), with theta_i = 0
  for every component whose period 2 pi / theta_i exceeds the training length L.
- modded-nanogpt's half-truncated RoPE (KellerJordan/modded-nanogpt train_gpt.py, ``Yarn.reset``
  and ``Yarn.rotary``): angular_freq = (1/1024)^linspace(0, 1, d/4), each repeated for an
  adjacent pair (2i, 2i+1), then d/2 zeros; x * cos + flip_pairs(x) * sin with the odd sines
  negated. pelab pairs (k, k + r/2): the test finds the permutation of the head dims that maps one
  onto the other.
- RoPE-ID ("Frayed RoPE", Wertheimer et al. 2026, arXiv 2603.18017): RoPE at high frequency on a
  subset of channels: the first d/4 dims, theta_k = 10000^(-2k/(d/4)), only pairs with a period
  of at most L, the other dims unrotated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from model.pe.rope import RoPE
from pelab.config import ConfigError, plain
from pelab.lit import build_position, model_config
from tests.naive import naive_rope

PRESETS = ("hope", "rope_half_truncated", "rope_frayed")


def preset(project_root, name, n_embd=256, n_head=4, block_size=256):
    """The scheme of ``pe=name`` as train.py builds it, for a model of this shape."""
    with initialize_config_dir(str(project_root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"pe={name}", f"model.n_embd={n_embd}", f"model.n_head={n_head}",
                                           f"model.block_size={block_size}"])
    return build_position(plain(cfg.pe), model_config({"vocab_size": 1, **plain(cfg.model)})).scheme


def pelab_pair_frequencies(pe):
    """(head_dim / 2,) float64 frequencies of pelab's pairs (k, k + r/2), then zeros for the unrotated dims."""
    theta = pe.frequencies(torch.arange(4)).inv_freq.double()
    return torch.cat((theta, theta.new_zeros((pe.head_dim - pe.rotary_dim) // 2)))


def hope_frequencies(d, L):
    """HoPE: RoPE's components whose period does not complete within L become position-independent."""
    theta = [10000.0 ** (-2 * i / d) for i in range(d // 2)]
    return torch.tensor([t if 2 * math.pi / t <= L else 0.0 for t in theta], dtype=torch.float64)


def modded_angular_freq(d):
    """modded-nanogpt Yarn.reset, per head dim (adjacent pairs), in float64."""
    angular_freq = (1 / 1024) ** np.linspace(0, 1, d // 4)
    return torch.tensor(np.concatenate([np.repeat(angular_freq, 2), np.zeros(d // 2)]), dtype=torch.float64)


def modded_rotary(x, positions, d):
    """modded-nanogpt Yarn.rotary: factor1 * x + factor2 * flip_pairs(x), factor2's odd entries negated."""
    theta = torch.outer(positions.double(), modded_angular_freq(d))
    factor1, factor2 = theta.cos(), theta.sin()
    factor2[..., 1::2] *= -1
    x_flip = x.view(*x.shape[:-1], d // 2, 2).flip(-1).view(x.shape)
    return factor1 * x + factor2 * x_flip


def frayed_frequencies(d, L):
    """RoPE-ID: RoPE on the first d/4 dims, the pairs completing a period within L; the rest unrotated."""
    r = d // 4
    theta = [10000.0 ** (-2 * k / r) for k in range(r // 2)]
    return torch.tensor([t if 2 * math.pi / t <= L else 0.0 for t in theta] + [0.0] * ((d - r) // 2),
                        dtype=torch.float64)


@pytest.mark.parametrize("n_embd, n_head, block_size", [(256, 4, 256), (256, 2, 1024), (96, 3, 64)])
def test_hope_drops_the_components_without_a_period_in_L(project_root, n_embd, n_head, block_size):
    pe = preset(project_root, "hope", n_embd, n_head, block_size)
    d = n_embd // n_head
    want = hope_frequencies(d, block_size)
    torch.testing.assert_close(pelab_pair_frequencies(pe), want, atol=0, rtol=1e-6)
    assert 0 < int((want > 0).sum()) < d // 2  # some kept, some dropped: the cut is exercised
    q = torch.randn(1, 1, 40, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 140)
    rotated, _ = pe.rotate(q.float(), q.float(), positions, positions)  # half-split pairs, dropped ones as they are
    ref = naive_rope(q[0, 0], positions.tolist())  # every pair rotates here: compare the kept ones
    kept = int((want > 0).sum())
    dims = [*range(kept), *range(d // 2, d // 2 + kept)]
    torch.testing.assert_close(rotated[0, 0, :, dims].double(), ref[:, dims], atol=5e-5, rtol=0)  # float32 angles
    rest = [i for i in range(d) if i not in dims]
    assert torch.equal(rotated[0, 0, :, rest], q.float()[0, 0, :, rest])


@pytest.mark.parametrize("n_embd, n_head", [(256, 4), (256, 8), (192, 2)])
def test_half_truncated_has_modded_nanogpts_frequencies_and_rotation(project_root, n_embd, n_head):
    pe = preset(project_root, "rope_half_truncated", n_embd, n_head)
    d = n_embd // n_head
    torch.testing.assert_close(pelab_pair_frequencies(pe), modded_angular_freq(d)[::2], atol=0, rtol=1e-6)
    # pelab's pair (k, k + d/4) is modded-nanogpt's adjacent pair (2k + 1, 2k); dims from d/2 on are unrotated in both
    perm = [*(2 * k + 1 for k in range(d // 4)), *(2 * k for k in range(d // 4)), *range(d // 2, d)]
    x = torch.randn(2, 3, 50, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(100, 150)
    q, k = pe.rotate(x[..., perm].float(), x[..., perm].float(), positions, positions)
    want = modded_rotary(x, positions, d)[..., perm]
    torch.testing.assert_close(q.double(), want, atol=5e-5, rtol=0)  # float32 angles
    torch.testing.assert_close(k.double(), want, atol=5e-5, rtol=0)


@pytest.mark.parametrize("n_embd, n_head, block_size", [(256, 2, 256), (256, 4, 1024)])
def test_frayed_rotates_a_quarter_of_the_channels_at_high_frequency(project_root, n_embd, n_head, block_size):
    pe = preset(project_root, "rope_frayed", n_embd, n_head, block_size)
    d = n_embd // n_head
    want = frayed_frequencies(d, block_size)
    torch.testing.assert_close(pelab_pair_frequencies(pe), want, atol=0, rtol=1e-6)
    assert 0 < int((want > 0).sum()) < d // 8


def test_presets_differ_from_rope_only_in_their_options(project_root):
    for name in PRESETS:
        assert type(preset(project_root, name)) is RoPE


@pytest.mark.parametrize("options, message", [
    (dict(max_period=5), "pe.max_period must be at least the shortest period 2 pi / theta_0 = 6.283 tokens "
                         "(a smaller one keeps no pair to rotate; no rotation at all is pe=nope), got 5"),
    (dict(min_frequency=1.5), "pe.min_frequency must be in (0, 1) with at least 2 rotary pairs (theta runs from 1 "
                              "down to it), got 1.5 with 16"),
    (dict(min_frequency=0.01, rotary_fraction=0.0625), "pe.min_frequency must be in (0, 1) with at least 2 rotary "
                                                       "pairs (theta runs from 1 down to it), got 0.01 with 1"),
    (dict(min_frequency=0.01, base=500.0), "pe.base and pe.min_frequency: set one of the two (min_frequency=0.01 sets "
                                           "base = min_frequency^(-n/(n-1))), got base=500.0"),
])
def test_bad_options_are_refused_in_one_line(project_root, options, message):
    from model.config import GPTConfig

    with pytest.raises(ValueError) as err:
        RoPE(GPTConfig(vocab_size=1, n_embd=128, n_head=4), **options)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # as validation reports it
        build_position({"_target_": "model.pe.rope.RoPE", **options},
                       GPTConfig(vocab_size=1, n_embd=128, n_head=4))
    assert message in str(err.value) and "\n" not in str(err.value)
