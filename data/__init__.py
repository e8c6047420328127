from data.corpus import GutenbergCorpus, HubCorpus
from data.tokenizers import TOKENIZERS, Tokenizer, get_tokenizer

__all__ = ["GutenbergCorpus", "HubCorpus", "TOKENIZERS", "Tokenizer", "get_tokenizer"]
