"""Position-encoding schemes, one per file. Importing this package registers them all."""

from model.pe.base import SCHEMES, PositionEncoding
from model.pe.alibi import ALiBi, alibi_slopes
from model.pe.fire import FIRE
from model.pe.kerple import KerpleLog, KerplePower
from model.pe.learned import LearnedPositionEmbedding
from model.pe.nope import NoPE
from model.pe.rope import RoPE
from model.pe.rope_alibi import RoPEALiBi
from model.pe.sinusoidal import SinusoidalPositionEmbedding
from model.pe.t5 import T5RelativeBias, t5_bucket
from model.pe.xpos import XPos

__all__ = [
    "SCHEMES",
    "PositionEncoding",
    "ALiBi",
    "alibi_slopes",
    "FIRE",
    "KerpleLog",
    "KerplePower",
    "LearnedPositionEmbedding",
    "NoPE",
    "RoPE",
    "RoPEALiBi",
    "SinusoidalPositionEmbedding",
    "T5RelativeBias",
    "t5_bucket",
    "XPos",
]
