"""Rolling log-likelihood of whole documents, windowed as lm-evaluation-harness's
``loglikelihood_rolling`` windows them, and its perplexity metrics.

A document of N tokens is read after one prefix token (the end-of-text token) as
``seq = [prefix] + tokens``. Its predictions are cut into chunks of L = ``max_length`` tokens,
tokens[a:b] for a = 0, L, 2L, ... and b = min(a + L, N), each scored from the window
``seq[max(0, b - L) : b]`` whose last ``b - a`` positions predict it. So the windows are
consecutive and do not overlap (lm-eval's ``context_len=1``): the token at offset j of a chunk
sees the j + 1 tokens of seq before it in its chunk's window, except in the last, shorter chunk,
whose window is a full L tokens reaching back into the chunk before.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import torch

from model.gpt import GPT


def rolling_windows(n_tokens: int, max_length: int) -> list[tuple[int, int, int]]:
    """(start, end, scored) of every window over ``[prefix] + tokens``: the model reads
    seq[start:end] and its last ``scored`` positions predict the chunk tokens[end - scored : end]."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    windows = []
    for a in range(0, n_tokens, max_length):
        b = min(a + max_length, n_tokens)
        windows.append((max(0, b - max_length), b, b - a))
    return windows


@torch.no_grad()
def rolling_loglikelihood(model: GPT, tokens: Sequence[int], prefix_token: int, max_length: int,
                          batch_size: int = 8) -> float:
    """Sum over the document of log p(token | the window before it), in nats (float64 sum)."""
    device = next(model.parameters()).device
    seq = torch.tensor([prefix_token, *tokens], device=device)
    windows = rolling_windows(len(tokens), max_length)
    total = 0.0
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        for length in sorted({end - start for start, end, _ in group}):  # one batch per window length
            same = [w for w in group if w[1] - w[0] == length]
            idx = torch.stack([seq[start:end] for start, end, _ in same])
            targets = torch.stack([seq[start + 1 : end + 1] for start, end, _ in same])
            nll = model.token_nll(idx, targets)
            total -= sum(row[-scored:].double().sum().item() for row, (_, _, scored) in zip(nll, same))
    return total


def count_words(text: str) -> int:
    """lm-eval's word count for rolling perplexity: the pieces between runs of whitespace."""
    return len(re.split(r"\s+", text))


def perplexity_metrics(loglikelihoods: Sequence[float], texts: Sequence[str], n_tokens: int) -> dict[str, float]:
    """lm-eval's corpus-level metrics of rolling log-likelihoods (each weighted by its document's
    words or UTF-8 bytes), and nats per token."""
    total = sum(loglikelihoods)
    words = sum(count_words(t) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {
        "nats_per_token": -total / n_tokens,
        "word_perplexity": math.exp(-total / words),
        "byte_perplexity": math.exp(-total / n_bytes),
        "bits_per_byte": -total / n_bytes / math.log(2),
    }
