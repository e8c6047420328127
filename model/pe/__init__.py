"""Position-encoding schemes, one per file. Importing this package registers them all."""

# Import order is the registry's order, in which comparisons list the schemes (evaluation/compare.py).
from model.pe.base import SCHEMES, PositionEncoding
from model.pe.learned import LearnedPositionEmbedding
from model.pe.sinusoidal import SinusoidalPositionEmbedding
from model.pe.rope import RoPE
from model.pe.alibi import ALiBi, alibi_slopes
from model.pe.xpos import XPos
from model.pe.rope_alibi import RoPEALiBi
from model.pe.fire import FIRE
from model.pe.kerple import KerpleLog, KerplePower
from model.pe.nope import NoPE
from model.pe.t5 import T5RelativeBias, t5_bucket
from model.pe.pope import PoPE
from model.pe.fox import FoX
from model.pe.cope import CoPE
from model.pe.rope_dd import DataDependentRoPE

__all__ = [
    "SCHEMES",
    "PositionEncoding",
    "ALiBi",
    "alibi_slopes",
    "CoPE",
    "FIRE",
    "FoX",
    "KerpleLog",
    "KerplePower",
    "LearnedPositionEmbedding",
    "NoPE",
    "PoPE",
    "RoPE",
    "RoPEALiBi",
    "SinusoidalPositionEmbedding",
    "T5RelativeBias",
    "t5_bucket",
    "XPos",
]
