from data.corpus import GutenbergCorpus, HubCorpus
from data.datamodule import TextDataModule
from data.tokenizers import TOKENIZERS, Tokenizer, get_tokenizer

__all__ = ["GutenbergCorpus", "HubCorpus", "TextDataModule", "TOKENIZERS", "Tokenizer", "get_tokenizer"]
