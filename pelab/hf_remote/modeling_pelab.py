"""A pelab model as transformers remote code: ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``.

pelab's exporter writes this file, unchanged, beside a flat copy of pelab's model/ package
(pelab_model_*.py) and config.json; it builds pelab's own GPT, so every number is pelab's.
config.json describes the model in pelab's terms: ``gpt``, GPTConfig's fields; ``pe``, the
scheme's registered name (``scheme``), its constructor's options (``options``) and its RoPE
scaling (``scaling``: RopeScaling's fields, or None); ``nope_layers`` and ``layer_rope``, GPT's
per-layer plan. The configuration class is here, not in a file of its own, so that it belongs to
this folder's code (transformers maps a configuration class to the model class it first loaded).
What else is here maps transformers' interface onto ``GPT.hidden``:

- ``attention_mask``: a row with masked tokens (left padding) runs alone without them, as if it
  had never been padded (their hidden states are zeros); ``position_ids`` are used as given;
- the cache (``cache``, formerly ``past_key_values``): pelab's KVCache (one per row when rows
  are padded), over every position the generation covers (``generate``'s max_length), as pelab's
  own ``generate`` does: decoding with the cache equals decoding without it.
"""

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .pelab_model_config import GPTConfig
from .pelab_model_generate import KVCache
from .pelab_model_gpt import GPT
from .pelab_model_pe_rope_scaling import RopeScaling
from .pelab_model_pe_schedule import LayerRope
from .pelab_schemes import SCHEMES

# the output's cache field: ``cache`` in transformers >= 5.2x, ``past_key_values`` before
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class PelabConfig(PretrainedConfig):
    model_type = "pelab"

    def __init__(self, gpt=None, pe=None, nope_layers=(), layer_rope=(), layer_bases=(), tie_word_embeddings=True,
                 **kwargs):
        self.gpt = dict(gpt or {"vocab_size": 256})
        self.pe = dict(pe or {"scheme": "nope", "options": {}, "scaling": None})
        self.nope_layers = list(nope_layers)
        # each layer's own RoPE [base, keep_fraction, scaled] or None; a folder written before held
        # layer_bases, a base or None per layer
        self.layer_rope = ([None if r is None else list(r) for r in layer_rope]
                           or [None if b is None else [b, None, True] for b in layer_bases])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def build_gpt(config: PelabConfig) -> GPT:
    gpt_config = GPTConfig(**config.gpt)
    scheme = SCHEMES[config.pe["scheme"]](gpt_config, **config.pe["options"])
    scaling = config.pe.get("scaling")
    if scaling is not None:  # JSON lists back to the tuples RopeScaling holds
        scheme.scale(RopeScaling(**{k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()}))
    layer_rope = tuple(None if r is None else LayerRope(*r) for r in config.layer_rope)
    return GPT(gpt_config, scheme, frozenset(config.nope_layers), layer_rope)


class PelabCache:
    """pelab's KV caches behind transformers' cache argument: one for the batch, or one per row
    when rows are padded, each over ``span`` (every position the generation covers)."""

    is_linear = (False,)  # transformers then feeds only the tokens not seen yet (get_seq_length)
    is_compileable = is_croppable = False

    def __init__(self, span_length: int) -> None:
        self.span_length, self.caches, self.seen = span_length, None, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen  # columns of input_ids already fed, padding included

    def for_rows(self, gpt: GPT, rows: int, device) -> list:
        if self.caches is None:
            span = torch.arange(self.span_length, device=device)
            self.caches = [KVCache(len(gpt.blocks), span, gpt.config.layer_windows) for _ in range(rows)]
        return self.caches


class PelabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PelabConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}

    def __init__(self, config: PelabConfig) -> None:
        super().__init__(config)
        with torch.device("cpu"):  # built for real, whatever device transformers builds on
            self.model = build_gpt(config)
        # the scheme's tables (non-persistent buffers, computed when built): transformers' loading empties them
        self._tables = {id(m): {k: b.clone() for k, b in m._buffers.items()
                                if b is not None and k in m._non_persistent_buffers_set} for m in self.model.modules()}
        self.post_init()

    def _init_weights(self, module) -> None:
        # GPT initialised its own weights (a scheme its own) when built; the folder's replace them
        for name, table in self._tables.get(id(module), {}).items():
            module._buffers[name] = table.to(module._buffers[name].device)

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value) -> None:
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value) -> None:
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, return_dict=None, span_length=None, past_key_values=None, **kwargs):
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("PelabForCausalLM takes input_ids (pelab's GPT embeds its own tokens), not inputs_embeds")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:  # a caller's own decoding loop: the span is the sequence or the context
            cache = PelabCache(max(input_ids.shape[1], self.model.config.block_size))
        logits = self.model.logits(self.hidden(input_ids, attention_mask, position_ids, cache, span_length))
        loss = None
        if labels is not None:  # next-token loss, labels aligned with input_ids (-100: ignored)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()

    def hidden(self, ids, attention_mask, position_ids, cache, span_length):
        """GPT.hidden of ``ids``: the batch at once, or row by row without its masked tokens."""
        B, T = ids.shape
        mask = None if attention_mask is None else attention_mask[:, -T:].bool()
        positions = None if position_ids is None else position_ids[..., -T:].expand(B, T)
        alike = positions is None or bool((positions == positions[:1]).all())
        together = (mask is None or bool(mask.all())) and alike
        if cache is not None:
            caches = cache.for_rows(self.model, 1 if together and cache.seen == 0 else B, ids.device)
            cache.seen += T
        elif span_length is not None:  # generate without a cache: the same span, in a fresh cache per forward
            caches = PelabCache(span_length).for_rows(self.model, 1 if together else B, ids.device)
        else:
            caches = [None] * (1 if together else B)
        if len(caches) == 1:  # every row alike: one forward
            return self.model.hidden(ids, None if positions is None else positions[0], cache=caches[0])
        rows = []
        for r, row_cache in enumerate(caches):
            keep = slice(None) if mask is None else mask[r]
            row_positions = None if positions is None else positions[r, keep]
            h = self.model.hidden(ids[r:r + 1, keep], row_positions, cache=row_cache)
            if mask is not None:  # the masked tokens' hidden states: zeros
                h, kept = h.new_zeros(1, T, h.shape[-1]), h
                h[:, keep] = kept
            rows.append(h)
        return torch.cat(rows)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs) -> None:
        """pelab's cache instead of transformers' (when ``use_cache``); either way the generation's
        length, the span every step's positions are read over (pelab's generate does the same)."""
        model_kwargs["span_length"] = generation_config.max_length
        if generation_config.use_cache and generation_config.num_beams > 1:
            raise ValueError("PelabForCausalLM's cache does not reorder beams: pass use_cache=False for beam search")
        if generation_config.use_cache and model_kwargs.get("cache") is None:
            model_kwargs["cache"] = PelabCache(generation_config.max_length)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, position_ids=None,
                                      span_length=None, **kwargs):
        seen = 0 if cache is None else cache.seen  # the cache holds the rest
        return {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask, "cache": cache,
                "position_ids": None if position_ids is None else position_ids[..., seen:],
                "span_length": span_length}
