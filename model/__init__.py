from model.config import GPTConfig
from model.gpt import GPT

__all__ = ["GPT", "GPTConfig"]
