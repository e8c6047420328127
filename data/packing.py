"""Packed documents: where the documents of a window start, from its tokens alone.

A token corpus keeps its documents apart with an end-of-text token after each one
(data/tokenizers.py); a window drawn anywhere in the stream holds the tail of one document,
then whole ones, then the head of another. The layout of a window is two (B, T) int64 tensors:

- ``documents``: the index of each token's document inside its window (0, 0, .., 1, 1, ..).
  The end-of-text token closes its document, so the token after it opens the next one.
- ``positions``: the token's offset from its document's first token inside the window.

The first, partial document starts at 0, not at its offset inside the whole document: the
window is all the context its tokens have (with a document mask they see nothing earlier), a
learned table has only ``block_size`` positions while a document's offset is unbounded, and the
layout stays a function of the window's tokens, the same in training, validation and every
evaluation script, so the training stream (data/stream.py) and its resume position are untouched.

``DocumentOptions`` says which of the two a forward uses (``data.document_positions``,
``data.document_mask``); ``MODES`` are the values of ``eval.documents``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# eval.documents: what evaluation reads of the layout; null there means "as the run trained"
MODES = ("none", "positions", "mask", "both")


def document_layout(idx: Tensor, eot_token: int) -> tuple[Tensor, Tensor]:
    """(positions, documents), both (B, T) int64, of token windows ``idx`` (B, T)."""
    ends = idx == eot_token
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]  # a document opens after an end-of-text token
    documents = starts.long().cumsum(dim=1)
    index = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # each token's document start
    return index - first, documents


@dataclass(frozen=True)
class DocumentOptions:
    """What a forward reads of the document layout."""

    positions: bool = False  # positions restart at every document start
    mask: bool = False  # a token attends only to earlier tokens of its own document
    eot_token: int | None = None  # the separator; None: the corpus has none

    @property
    def mode(self) -> str:
        return MODES[self.positions + 2 * self.mask]

    @classmethod
    def of_mode(cls, mode: str, eot_token: int | None) -> DocumentOptions:
        if mode not in MODES:
            raise ValueError(f"eval.documents={mode!r} is not valid; allowed: null (as the run trained), "
                             f"{', '.join(MODES)}")
        return cls(mode in ("positions", "both"), mode in ("mask", "both"), eot_token)

    def resolve(self, mode: str | None) -> DocumentOptions:
        """This run's options for an ``eval.documents`` value (None: these)."""
        return self if mode is None else DocumentOptions.of_mode(mode, self.eot_token)

    def layout(self, idx: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(positions or None, documents or None) for ``GPT.forward`` / ``hidden``."""
        if not (self.positions or self.mask):
            return None, None
        if self.eot_token is None:
            raise ValueError("document positions or masks need a corpus with document separators (an end-of-text "
                             "token); this one has none")
        positions, documents = document_layout(idx, self.eot_token)
        return (positions if self.positions else None), (documents if self.mask else None)


def check_document_options(document_positions: bool, document_mask: bool, corpus, eot_token: int | None = None,
                           data: str = "data") -> None:
    """Refuse either option on a corpus with no document separators, before any data is read."""
    for key, value in (("document_positions", document_positions), ("document_mask", document_mask)):
        if not isinstance(value, bool):
            raise ValueError(f"data.{key}={value!r} is not valid; allowed: true or false")
    if not (document_positions or document_mask):
        return
    key = "document_mask" if document_mask else "document_positions"
    name = getattr(corpus, "cache_name", type(corpus).__name__)
    if not getattr(corpus, "rows_are_documents", True):
        raise ValueError(f"data.{key}=true needs documents separated in the token stream, and {data} corpus {name} "
                         f"has none (rows_are_documents: false: its rows are lines of one running text); set "
                         f"data.{key}=false or use a corpus whose rows are documents")
