"""A pelab model (a nanoGPT-style decoder with a pluggable position scheme) as transformers
remote code: ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)``.

pelab's scripts/export_hf.py writes this file, unchanged, beside config.json and the weights;
it imports only torch and transformers. Every position formula is pelab's (model/pe/ in the
pelab repository), computed in float32 from the options in config.json (configuration_pelab.py
describes them), and the weights keep pelab's own names under ``model.``.

Attention is written out: softmax(q k^T / sqrt(d) + position bias, causal and window masked) v,
in float32 (with attention sinks in the denominator, or stick-breaking instead of the softmax). There is no KV cache: ``generate`` reads the whole sequence at every step, because
some positions are functions of the whole text (xPos's reference point, dynamic NTK's length).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_pelab import PelabConfig

RMS_EPS = 1e-6  # pelab's RMSNorm (model.norm=rmsnorm, QK-norm)


# ---------------------------------------------------------------------------------------------
# rotations: RoPE (with its options and scalings), xPos, PoPE

def ntk_inv_freq(inv_freq, scale):
    """theta_k * scale^(-2k/(d-2)): the frequencies of base * scale^(d/(d-2))."""
    d = 2 * inv_freq.numel()
    k = torch.arange(inv_freq.numel(), dtype=torch.float64, device=inv_freq.device)
    return (inv_freq.double() * scale ** -(2 * k / max(d - 2, 1))).float()


def yarn_ramp(s, inv_freq):
    """YaRN's share of each pair that is interpolated (jquesnelle/yarn, HF's _compute_yarn_parameters)."""
    n, d = inv_freq.numel(), 2 * inv_freq.numel()
    k = torch.arange(n, dtype=torch.float64, device=inv_freq.device)
    if n == 1:
        return torch.zeros_like(k)
    log_base = -inv_freq[-1].double().log() * d / (d - 2)

    def corr(rotations):
        return d * math.log(s["original_length"] / (2 * math.pi * rotations)) / (2 * log_base)

    low, high = corr(s["beta_fast"]), corr(s["beta_slow"])
    if s["truncate"]:
        low, high = low.floor(), high.ceil()
    low, high = low.clamp(min=0), high.clamp(max=d - 1)
    high = torch.where(low == high, high + 0.001, high)
    return ((k - low) / (high - low)).clamp(0.0, 1.0)


def scaled_frequencies(s, inv_freq, length):
    """(frequencies, position scale, attention factor) of a RoPE scaling ``s`` at context length
    ``length`` (the largest position + 1)."""
    kind, factor, L = s["kind"], s["factor"], s["original_length"]
    if kind == "linear":
        return inv_freq, 1.0 / factor, 1.0
    if kind == "ntk":
        return ntk_inv_freq(inv_freq, float(factor)), 1.0, 1.0
    if kind == "dynamic_ntk":
        T = torch.as_tensor(length, device=inv_freq.device).double()
        return ntk_inv_freq(inv_freq, (factor * T / L - (factor - 1)).clamp(min=1.0)), 1.0, 1.0
    theta = inv_freq.double()
    if kind == "yarn":
        ramp = yarn_ramp(s, inv_freq)
        theta = ramp * theta / factor + (1 - ramp) * theta
        attention = 0.1 * math.log(factor) + 1.0 if s["attention_factor"] is None else s["attention_factor"]
        return theta.float(), 1.0, attention
    if kind == "llama3":
        wavelength = 2 * math.pi / theta
        low, high = s["low_freq_factor"], s["high_freq_factor"]
        smooth = ((L / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        return ((1 - smooth) * theta / factor + smooth * theta).float(), 1.0, 1.0
    if kind == "longrope":
        short = torch.tensor(s["short_factor"], dtype=torch.float64, device=inv_freq.device)
        long = torch.tensor(s["long_factor"], dtype=torch.float64, device=inv_freq.device)
        theta = theta / torch.where(torch.as_tensor(length, device=inv_freq.device) > L, long, short)
        if s["attention_factor"] is not None:
            attention = s["attention_factor"]
        else:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(L))
        return theta.float(), 1.0, attention
    raise ValueError(f"pe.rotate.scaling.kind={kind!r} is not one of linear, ntk, dynamic_ntk, yarn, llama3, longrope")


def swap_halves(x, half):
    return torch.cat((x[..., half: 2 * half], x[..., :half], x[..., 2 * half:]), dim=-1)


def rope_tables(rot, positions, span, base, log_freq_scale, head_dim):
    """Full-width float32 (q_cos, q_sin, k_cos, k_sin): pairs (x[k], x[k + r/2]) of the first r dims
    turn by p theta_k; cos = (c, c, 1..), sin = (-s, s, 0..), so x' = x cos + swap(x) sin."""
    r = rot["rotary_dim"]
    k2 = torch.arange(0, r, 2, dtype=torch.float64)
    inv_freq = (base ** (-k2 / r)).float().to(positions.device)
    if log_freq_scale is not None:  # learned theta_k * exp(alpha_k)
        inv_freq = inv_freq * log_freq_scale.float().exp()
    position_scale, attention = 1.0, 1.0
    if rot["scaling"] is not None:
        inv_freq, position_scale, attention = scaled_frequencies(rot["scaling"], inv_freq, span.max() + 1)
    if rot["kept_pairs"] < r // 2:  # p-RoPE / HoPE: the lowest frequencies do not turn
        inv_freq = inv_freq * (torch.arange(r // 2, device=inv_freq.device) < rot["kept_pairs"]).float()
    p = positions.float()
    if position_scale != 1.0:
        p = p * position_scale
    angles = p[..., None] * inv_freq
    scales = (None, None)
    if rot.get("xpos"):  # zeta^((p - c)/B) on the query, zeta^(-(p - c)/B) on the key; c the span's middle
        gamma, scale_base = rot["xpos"]["gamma"], rot["xpos"]["scale_base"]
        zeta = (torch.arange(0, r, 2, dtype=torch.float32, device=p.device) / r + gamma) / (1 + gamma)
        center = (span.min() + span.max()) // 2
        scales = tuple(zeta ** (sign * (positions - center).float()[..., None] / scale_base) for sign in (1.0, -1.0))
    tables = []
    for scale in scales:
        cos, sin = angles.cos(), angles.sin()
        if attention != 1.0:  # YaRN / LongRoPE: on q and on k
            scale = attention if scale is None else scale * attention
        if scale is not None:
            cos, sin = cos * scale, sin * scale
        rest = cos.new_ones(()).expand(*cos.shape[:-1], head_dim - r)
        tables += [torch.cat((cos, cos, rest), dim=-1), torch.cat((-sin, sin, rest * 0), dim=-1)]
    return tuple(t[:, None] if t.dim() == 3 else t for t in tables)  # per-sequence positions: a head dim


def rotate(q, k, tables, rot):
    q_cos, q_sin, k_cos, k_sin = tables
    half = rot["rotary_dim"] // 2
    return (torch.addcmul(q * q_cos, swap_halves(q, half), q_sin),
            torch.addcmul(k * k_cos, swap_halves(k, half), k_sin))


def pope_tables(rot, positions, delta, head_dim):
    """PoPE's phases: queries i theta_c - delta_hc, keys j theta_c, one frequency per component."""
    c = torch.arange(head_dim, dtype=torch.float64)
    inv_freq = (rot["base"] ** (-c / head_dim)).float().to(positions.device)
    angles = positions.float()[..., None] * inv_freq
    if angles.dim() == 3:
        angles = angles[:, None]
    q_angles = angles - delta.float().clamp(-2 * math.pi, 0.0)[:, None, :]
    return q_angles.cos(), q_angles.sin(), angles.cos(), angles.sin()


def pope(q, k, tables):
    """q and k as 2d-dim polar vectors [m cos, m sin], m = softplus; q times sqrt 2 so that the
    1/sqrt(2d) of the attention is PoPE's 1/sqrt(d)."""
    q_cos, q_sin, k_cos, k_sin = tables
    mq, mk = F.softplus(q.float()) * math.sqrt(2.0), F.softplus(k.float())
    return (torch.cat((mq * q_cos, mq * q_sin), dim=-1).to(q.dtype),
            torch.cat((mk * k_cos, mk * k_sin), dim=-1).to(k.dtype))


# ---------------------------------------------------------------------------------------------
# biases

def t5_bucket(distance, num_buckets, max_distance):
    """T5's unidirectional relative-position bucket of integer distances (negatives: 0)."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    scaled = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


def cope_terms(q, scores, visible, table):
    """CoPE's logit terms: gates sigmoid(q.k / sqrt(d)) of the visible keys, positions p_ij = sum_{t=j..i}
    g_it clamped to the table's last row, q . e interpolated between floor p and ceil p, over sqrt(d)."""
    gates = torch.sigmoid(scores) * visible
    p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=table.shape[0] - 1)
    fixed = torch.matmul(q, table.t())
    floor = p.detach().floor()
    w = p - floor
    low, high = fixed.gather(-1, floor.long()), fixed.gather(-1, p.detach().ceil().long())
    return (high * w + low * (1 - w)) * (1.0 / math.sqrt(q.shape[-1]))


# the kinds of each part of config.json's pe this file computes
KINDS = {"embed": ("learned", "sinusoidal"), "rotate": ("rope", "pope"),
         "bias": ("slopes", "t5", "kerple_log", "kerple_power", "fire"), "gates": ("fox",), "scores": ("cope",)}


class Positions(nn.Module):
    """The scheme's learned tensors under pelab's names, and its three hooks: ``embed``,
    ``tables`` (rotation) and ``bias``."""

    def __init__(self, config):
        super().__init__()
        pe, H, hd = config.pe, config.n_head, config.n_embd // config.n_head
        for part, kinds in KINDS.items():  # a folder written by a newer pelab: say so, never compute another model
            kind = (pe.get(part) or {}).get("kind", kinds[0])
            if kind not in kinds:
                raise ValueError(f"config.json pe.{part}.kind={kind!r} is not one of {', '.join(kinds)}: "
                                 f"this modeling_pelab.py does not compute it")
        self.embed_part, self.rotate_part, self.bias_part = pe.get("embed"), pe.get("rotate"), pe.get("bias")
        self.gates = None
        if pe.get("gates"):  # FoX: each layer's per-head forget gate of the attention's input
            self.gates = nn.ModuleList(nn.Linear(config.n_embd, H, bias=True) for _ in range(config.n_layer))
        if pe.get("scores"):  # CoPE: each layer's table e (npos, head_dim) of context positions
            self.context_table = nn.Parameter(torch.zeros(config.n_layer, pe["scores"]["npos"], hd))
        self.head_dim, self.n_embd = hd, config.n_embd
        if self.embed_part and self.embed_part["kind"] == "learned":
            self.wpe = nn.Embedding(self.embed_part["positions"], config.n_embd)
        rot = self.rotate_part or {}
        if rot.get("learnable_freq"):
            self.log_freq_scale = nn.Parameter(torch.zeros(rot["rotary_dim"] // 2))
        if rot.get("kind") == "pope":
            self.delta = nn.Parameter(torch.zeros(H, hd))
        kind = (self.bias_part or {}).get("kind")
        if kind == "t5":
            self.relative_attention_bias = nn.Embedding(self.bias_part["num_buckets"], H)
        elif kind in ("kerple_log", "kerple_power"):
            self.r1, self.r2 = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        elif kind == "fire":
            self.mlp = nn.Sequential(nn.Linear(1, self.bias_part["mlp_width"]), nn.ReLU(),
                                     nn.Linear(self.bias_part["mlp_width"], H))
            self.c, self.threshold_multiplier = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
            self.register_buffer("init_threshold", torch.tensor(1.0))

    def embed(self, x, positions):
        part = self.embed_part
        if part is None:
            return x
        if part["kind"] == "learned":
            if int(positions.max()) >= part["positions"]:
                raise ValueError(f"the learned position table has {part['positions']} positions, got position "
                                 f"{int(positions.max())}: it cannot extrapolate past its table")
            return x + self.wpe(positions).to(x.dtype)
        k2 = torch.arange(0, self.n_embd, 2, device=positions.device, dtype=torch.float32)
        angles = positions.float()[..., None] * part["base"] ** (-k2 / self.n_embd)
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # sin on even dims, cos on odd
        return x + (part["scale"] * table).to(x.dtype)

    def tables(self, positions, base):
        rot = self.rotate_part
        if rot is None:
            return None
        if rot["kind"] == "pope":
            return pope_tables(rot, positions, self.delta, self.head_dim)
        return rope_tables(rot, positions, positions, rot["base"] if base is None else base,
                           getattr(self, "log_freq_scale", None), self.head_dim)

    def rotate(self, q, k, tables):
        if self.rotate_part["kind"] == "pope":
            return pope(q, k, tables)
        return rotate(q, k, tables, self.rotate_part)

    def bias(self, positions):
        """(..., H, T, T) float32 logits added at query and key positions, or None."""
        part = self.bias_part
        if part is None:
            return None
        d = positions[..., :, None] - positions[..., None, :]
        kind = part["kind"]
        if kind == "slopes":  # ALiBi: -m_h (i - j)
            slopes = torch.tensor(part["slopes"], dtype=torch.float32, device=d.device)
            return -slopes[:, None, None] * d.float().unsqueeze(-3)
        if kind == "t5":
            values = self.relative_attention_bias(t5_bucket(d, part["num_buckets"], part["max_distance"])).float()
        elif kind in ("kerple_log", "kerple_power"):  # r1, r2 clamped into range as pelab's forward
            r1 = self.r1.clamp(min=part["eps"])
            r2 = self.r2.clamp(min=part["eps"], max=part["r2_max"])
            distance = d.float().abs()[..., None]
            values = -r1 * (torch.log1p(r2 * distance) if kind == "kerple_log" else distance.pow(r2))
        else:  # FIRE: f(psi(i - j) / psi(max(i, L))), psi(x) = log(|c x| + 1)
            def psi(x):
                return torch.log(torch.abs(self.c[0] * x) + 1)

            threshold = (self.threshold_multiplier[0] * self.init_threshold).abs()
            normalizer = psi(torch.maximum(positions.float(), threshold)) + part["eps"]
            x = psi(d.float()) / normalizer[..., :, None]
            values = self.mlp(x[..., None].to(self.mlp[0].weight.dtype)).float()
        return values.movedim(-1, -3)


# ---------------------------------------------------------------------------------------------
# the decoder

def norm_layer(config, dim):
    return nn.RMSNorm(dim, eps=RMS_EPS) if config.norm == "rmsnorm" else nn.LayerNorm(dim, bias=config.bias)


SINKS, NORMALISERS = ("none", "learned", "zero"), ("softmax", "stick_breaking")


def stick_breaking(logits):
    """A_ij = sigmoid(z_ij) prod_{j<k<=i} (1 - sigmoid(z_ik)) over the visible keys, in log space."""
    visible = logits > float("-inf")
    z = logits.masked_fill(~visible, 0.0)
    take = F.logsigmoid(z).masked_fill(~visible, float("-inf"))
    passed = F.logsigmoid(-z).masked_fill(~visible, 0.0)
    later = F.pad(passed[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # sum over the keys after j
    return torch.exp(take + later)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        for key, value, allowed in (("sinks", config.sinks, SINKS), ("normaliser", config.normaliser, NORMALISERS)):
            if value not in allowed:  # a folder written by a newer pelab: say so, never compute another model
                raise ValueError(f"config.json {key}={value!r} is not one of {', '.join(allowed)}: "
                                 f"this modeling_pelab.py does not compute it")
        self.normaliser = config.normaliser
        # one logit per head in every softmax denominator (gpt-oss); zero: the off-by-one softmax, built in
        # forward (a buffer would be left uninitialised by from_pretrained: no weight holds it)
        self.sink_kind = config.sinks
        if config.sinks == "learned":
            self.sinks = nn.Parameter(torch.zeros(config.n_head))
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.kv_dim = self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * self.kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=RMS_EPS) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=RMS_EPS) if config.qk_norm else None
        temperature = config.attn_temperature or {}
        if temperature.get("kind") == "ssmax":  # this layer's learned s_h
            self.ssmax = nn.Parameter(torch.ones(config.n_head))

    def forward(self, x, positions: Positions, layer):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(x).split((C, self.kv_dim, self.kv_dim), dim=2))
        if self.q_norm is not None:
            q, k = self.q_norm(q.float()).to(q.dtype), self.k_norm(k.float()).to(k.dtype)
        if layer["tables"] is not None:
            q, k = positions.rotate(q, k, layer["tables"])
        if layer["q_scale"] is not None:  # attention temperature, in float32
            scale = layer["q_scale"]
            if hasattr(self, "ssmax"):
                scale = self.ssmax[:, None, None] * scale
            q = (q * scale).to(q.dtype)
        if self.n_kv_head != self.n_head:  # query head h reads key/value head h // group
            group = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if layer["cope"] is not None:
            scores = scores + cope_terms(q.float(), scores, ~layer["hidden"], layer["cope"].float())
        if layer["bias"] is not None:
            scores = scores + layer["bias"]
        if layer["gate"] is not None:  # FoX: + sum_{t=j+1..i} log f_t = c_i - c_j, c summed in float64
            c = torch.cumsum(F.logsigmoid(layer["gate"](x.float())).transpose(1, 2).double(), dim=-1)
            scores = scores + (c[..., :, None] - c[..., None, :]).float()
        logits = scores.masked_fill(layer["hidden"], float("-inf"))
        if self.normaliser == "stick_breaking":
            probs = stick_breaking(logits)
        elif self.sink_kind != "none":  # exp(z_ij) / (exp(s_h) + sum_k exp(z_ik))
            sink = self.sinks.float() if self.sink_kind == "learned" else logits.new_zeros(self.n_head)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            probs = torch.exp(logits - torch.logaddexp(lse, sink[:, None, None]))
        else:
            probs = torch.softmax(logits, dim=-1)
        y = torch.matmul(probs, v.float()).to(v.dtype).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gated = config.mlp == "swiglu"
        hidden = config.mlp_hidden
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden if self.gated else hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        h = self.c_fc(x)
        if self.gated:  # c_fc's rows are [gate; up]
            gate, up = h.chunk(2, dim=-1)
            return self.c_proj(F.silu(gate) * up)
        return self.c_proj(F.gelu(h))  # exact (erf) GELU


class PelabBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = norm_layer(config, config.n_embd), Attention(config)
        self.ln_2, self.mlp = norm_layer(config, config.n_embd), MLP(config)

    def forward(self, x, positions, layer):
        x = x + self.attn(self.ln_1(x), positions, layer)
        return x + self.mlp(self.ln_2(x))


def query_scales(temperature, T, attention_mask, device):
    """The attention temperature's per-query factor of q, (T, 1) or (B, 1, T, 1), or None."""
    kind = temperature["kind"]
    if kind in ("log_length", "ssmax"):  # ln n, n the keys a query sees
        if attention_mask is None:
            n = torch.arange(1, T + 1, device=device)
        else:
            n = attention_mask.long().cumsum(-1).clamp(min=1)
        scale = n.float().log()
        if kind == "log_length":
            scale = scale / math.log(temperature["length"])
    elif kind == "llama4":  # 1 + a ln(floor((t + 1) / F) + 1), t the token index
        t = torch.arange(T, device=device).float()
        scale = torch.log1p(torch.floor((t + 1.0) / temperature["floor"])) * temperature["scale"] + 1.0
    else:
        raise ValueError(f"config.json attn_temperature.kind={kind!r} is not one of log_length, llama4, ssmax")
    return scale[:, None, :, None] if scale.dim() == 2 else scale[:, None]


class PelabPreTrainedModel(PreTrainedModel):
    config_class = PelabConfig
    base_model_prefix = "model"
    _no_split_modules = ["PelabBlock"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # no KV cache (module docstring)


class PelabModel(PelabPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.pe = Positions(config)
        self.blocks = nn.ModuleList(PelabBlock(config) for _ in range(config.n_layer))
        self.ln_f = norm_layer(config, config.n_embd)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def layers(self, positions, attention_mask, T, device):
        """Each layer's rotation tables, bias, hidden keys and query scale, built once per distinct layer."""
        config = self.config
        index = torch.arange(T, device=device)
        later = index[None, :] > index[:, None]
        pad = None
        if attention_mask is not None:  # a padded key is hidden from every query but itself
            pad = (attention_mask[:, None, None, :] == 0) & ~torch.eye(T, dtype=torch.bool, device=device)
        temperature = config.attn_temperature
        q_scale = None if temperature is None else query_scales(temperature, T, attention_mask, device)
        bias = self.pe.bias(positions) if self.pe.bias_part is not None else None
        tables, hidden, layers = {}, {}, []
        for i in range(config.n_layer):
            with_pe = i not in config.nope_layers
            base = config.layer_bases[i] if with_pe else None
            if with_pe and base not in tables:
                tables[base] = self.pe.tables(positions, base)
            window = config.layer_windows[i]
            if window not in hidden:  # token order decides, as pelab's causal and window masks
                mask = later if window is None else later | (index[None, :] <= index[:, None] - window)
                hidden[window] = mask if pad is None else mask | pad
            scaled = temperature is not None and i in temperature["layers"]
            gate = self.pe.gates[i] if with_pe and self.pe.gates is not None else None
            cope = self.pe.context_table[i] if with_pe and hasattr(self.pe, "context_table") else None
            layers.append({"tables": tables[base] if with_pe else None, "bias": bias if with_pe else None, "gate": gate,
                           "cope": cope, "hidden": hidden[window], "q_scale": q_scale if scaled else None})
        return layers

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        if position_ids is not None:
            positions = position_ids
        elif attention_mask is not None:  # left padding: each sequence counts from its first token
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            positions = torch.arange(T, device=x.device)
        x = self.pe.embed(x, positions)
        for block, layer in zip(self.blocks, self.layers(positions, attention_mask, T, x.device)):
            x = block(x, self.pe, layer)
        return self.ln_f(x)


class PelabForCausalLM(PelabPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = PelabModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                return_dict=None, **kwargs):
        hidden = self.model(input_ids, attention_mask, position_ids, inputs_embeds)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # next-token loss, labels aligned with input_ids (-100: ignored)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits)
        return output if return_dict is not False else output.to_tuple()

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}  # the whole sequence: no cache
