"""The configuration of a pelab model exported as transformers remote code (modeling_pelab.py).

pelab's scripts/export_hf.py writes this file, unchanged, beside config.json; it imports only
transformers. Position information is described by parts, each computed as pelab computes it:

- ``pe["embed"]``: added to the token embeddings: ``{"kind": "learned", "positions": N}`` or
  ``{"kind": "sinusoidal", "base", "scale"}``;
- ``pe["rotate"]``: applied to q and k: ``{"kind": "rope", "base", "rotary_dim", "kept_pairs",
  "learnable_freq", "scaling", "xpos"}`` (xPos: ``{"gamma", "scale_base"}``) or
  ``{"kind": "pope", "base"}``;
- ``pe["bias"]``: added to the attention logits: ``{"kind": "slopes", "slopes"}`` (ALiBi),
  ``{"kind": "t5", "num_buckets", "max_distance"}``, ``{"kind": "kerple_log" | "kerple_power",
  "eps", "r2_max"}`` or ``{"kind": "fire", "eps"}``;
- ``pe["gates"]``: FoX's per-layer forget gates of the attention input: ``{"kind": "fox"}``;
- ``pe["scores"]``: CoPE's per-layer tables of context positions counted by gates of the scores:
  ``{"kind": "cope", "npos"}``.

Layers in ``nope_layers`` use none of rotate, bias, gates and scores; ``layer_bases[i]`` (when not None) is layer
i's RoPE base; ``layer_windows[i]`` its sliding window (None: full causal attention);
``attn_temperature`` scales the queries of the layers it lists; ``sinks`` (none, learned, zero)
joins a logit per head to every softmax denominator; ``normaliser`` stick_breaking replaces the softmax.
"""

from transformers import PretrainedConfig


class PelabConfig(PretrainedConfig):
    model_type = "pelab"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}

    def __init__(self, vocab_size=256, n_layer=2, n_head=4, n_embd=64, n_kv_head=None, bias=False, norm="layernorm",
                 mlp="gelu", mlp_hidden=None, qk_norm=False, max_position_embeddings=256, layer_windows=None,
                 nope_layers=None, layer_bases=None, attn_temperature=None, pe=None, pelab_scheme="nope",
                 sinks="none", normaliser="softmax", tie_word_embeddings=True, use_cache=False, **kwargs):
        self.vocab_size, self.n_layer, self.n_head, self.n_embd = vocab_size, n_layer, n_head, n_embd
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.bias, self.norm, self.mlp, self.qk_norm = bias, norm, mlp, qk_norm
        self.mlp_hidden = 4 * n_embd if mlp_hidden is None else mlp_hidden
        self.max_position_embeddings = max_position_embeddings
        self.layer_windows = list(layer_windows or [None] * n_layer)
        self.nope_layers = list(nope_layers or [])
        self.layer_bases = list(layer_bases or [None] * n_layer)
        self.attn_temperature = attn_temperature  # None, or {"kind", "layers", ...}
        self.pe = dict(pe or {})
        self.sinks, self.normaliser = sinks, normaliser  # attention sinks; softmax or stick_breaking
        self.pelab_scheme = pelab_scheme  # pelab's pe= name, for the reader
        self.use_cache = use_cache  # no KV cache: each step of generate reads the whole sequence
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
