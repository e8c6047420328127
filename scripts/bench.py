"""Training-speed benchmark: pelab's real training path against an independent plain-PyTorch loop.

    python scripts/bench.py                                    # CPU default, 8-17 min on 2 cores
    python scripts/bench.py configs=byte-tiny,gpt2-tiny precision=bf16-mixed,32 compile=false,true \\
        schemes=learned,rope,alibi rounds=12 out=bench.jsonl
    python scripts/bench.py smoke=true                         # seconds: what tests/test_bench.py runs

What is timed, on the same random token batches:

- ``reference``: a nanoGPT-style training loop written here with its own model code (not
  pelab's GPT): token + learned absolute position embeddings, pre-LN blocks with causal SDPA
  (``is_causal=True``), GELU MLP, tied LM head, full logits + ``F.cross_entropy``; AdamW
  (decay on matrices only, pelab's hyperparameters, fused only on CUDA), gradient clipping 1.0,
  warmup + cosine LR through a ``LambdaLR`` lambda; bf16 autocast or fp32; optionally
  ``torch.compile`` of the model.
- ``pelab`` (one per scheme of ``model.pe.SCHEMES``): ``LitGPT`` fitted by a lightning
  ``Trainer`` with the trainer settings of conf/trainer/default.yaml (precision, gradient
  clipping, log_every_n_steps) and the callbacks of conf/callbacks/default.yaml minus those that
  only write files or probe at validation / at the end (model_checkpoint, attention_maps,
  position_functions, end_of_training). No validation loader, ``limit_val_batches=0``,
  ``enable_checkpointing=False``, ``max_steps=10**9`` (the bench stops the fit itself): no
  validation or checkpointing ever runs inside the timed region, whatever ``steps`` is.
- ``pelab-loop`` (``loop=true``, the default): pelab's GPT with learned positions, as built by
  ``LitGPT``, trained by the reference's loop above: against ``reference`` it measures pelab's
  model, against ``pelab`` ``learned`` the Lightning loop and callbacks.

Every path runs in its own process, forked from a server that has imported torch and lightning
but computed nothing, so it trains in its process's main thread with its own allocator and OpenMP
team as a real run does (threads sharing one process measured allocation-heavy paths up to 1.3x
slower than they run alone). Exactly one path runs at a time (a baton): after ``warmup``
untimed steps each, ``rounds`` rounds follow, each giving every path 1 + ``steps`` consecutive
steps, of which the first (right after the switch from another path: cold caches, a sleeping
OpenMP team) is not timed; the order rotates by one path per round and is reversed every other
round, so every path sits at every place. A step's time is the wall time between consecutive
step ends (``time.perf_counter``; for pelab at ``on_train_batch_end`` of the last callback), so
data loading, every hook, the optimizer and the LR scheduler are inside it. Other processes on
a shared machine only ever add time to a step, so each round is summarised by its fastest
step: ``step_ms`` is the median over rounds of the per-round fastest step (``tokens_per_s`` =
batch tokens / ``step_ms``; ``step_ms_all_median``, the plain median of every timed step, is
given too). Ratios are paired by round: the median over rounds of the ratio of the two paths'
per-round fastest steps, so slow drifts of the machine's load cancel.

Output: a table on stdout, and one JSON object per (config, precision, compile, path) row,
printed on stdout as ``BENCH_JSON {...}`` lines and, with ``out=FILE``, written to FILE (one
object per line). Fields:

- ``config`` (``byte-tiny``, ``gpt2-small``, ...: vocabulary and conf/model size), ``scheme``,
  ``path`` (``pelab``, ``reference`` or ``pelab-loop``), ``precision``, ``compile``, ``device``, ``batch_size``,
  ``block_size``, ``step_ms`` (median), ``tokens_per_s``;
- ``ratio_vs_reference``: pelab tokens/s / reference tokens/s, on the ``learned`` rows (the
  reference's scheme) and the ``pelab-loop`` row; null on other schemes; 1.0 on the reference row;
- ``ratio_vs_learned``: this scheme's tokens/s / pelab ``learned``'s, same config;
- ``ratio_vs_eager``: with ``compile=false,true``, a compiled path's tokens/s / the same path's
  eager tokens/s (eager and compiled paths of a config run interleaved in the same rounds);
  null otherwise;
- ``ratio_vs_reference_ci95``, ``ratio_vs_learned_ci95``, ``ratio_vs_eager_ci95``: [low, high],
  a distribution-free confidence interval (at least 95%) of that median from the per-round
  ratios (order statistics; with 10 rounds the 2nd and 9th smallest); null with fewer than 6
  rounds and where the ratio is null or trivially 1. Two runs whose intervals overlap do not
  disagree; an interval wider than a target's margin says: more ``rounds`` or ``steps``;
- ``cpu_ms``, ``ratio_vs_reference_cpu``, ``ratio_vs_learned_cpu``: the same statistics from
  the process's CPU time per step (``time.process_time``), a cross-check that depends less on
  what other processes do (it undercounts single-threaded parts relative to wall time);
- ``compile_s``: with compile, the first ``warmup`` steps minus ``warmup`` steady (median) steps;
- ``peak_mem_mb``: training memory (model, gradients, AdamW state, activations) of a few steps
  of the same path in a fresh child process: on CUDA ``torch.cuda.max_memory_allocated``; on
  CPU the rise of the process's peak RSS (``resource.getrusage`` ru_maxrss, child forked from a
  process that has imported torch and lightning but computed nothing) above its RSS before the
  model is built; ``peak_mem_method`` says which;
- ``mfu``: ``flops_per_token`` (``LitGPT.flops_per_token``: 6N + 12·L·d·T; the same formula for
  the reference) x tokens/s / device peak; ``peak_tflops`` and ``peak_source``: on CUDA
  lightning's table of the device's peak; on CPU a peak *measured here*, once at the start, as
  the best of repeated 2048^3 matmuls in the compute dtype (so CPU MFU is relative to the
  achievable matmul rate);
- ``eval_s_16x``, ``eval_peak_mem_mb_16x``, ``eval_length``: ``GPT.token_nll`` with
  ``q_chunk=1024`` (as evaluation/extrapolation.py) at 16x the training length, batch
  max(1, 4096 // length) (one sequence at 16x 256), eval mode, under the row's precision, median of 2 after one warm-up, peak
  memory as above, in a child process; the learned scheme is built with a 16x position table
  for this (its trained table cannot reach that far; the time is what is measured).
  Evaluation does not depend on ``compile`` (the extrapolation code runs the eager module).
  With ``eval_factor=16,32,64`` (several factors) every evaluation runs one sequence, the
  ``_16x`` fields come from factor 16 (else the largest), and the row also gets ``eval_curve``
  ([{length, batch, s, peak_mb}] per factor) and ``eval_mem_exponent``, the log-log slope of
  peak memory against length (1: linear in T; 2: quadratic).
- ``load_avg``: the 1-minute load average at the start and end of the config's timing.

Speed targets live in issue 10 and the README, never in tests.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

from _common import ROOT, describe_options, parse_key_values, split_list

OPTIONS = {
    "configs": "comma-separated VOCAB-SIZE[:scheme+scheme...], VOCAB byte|gpt2, SIZE a conf/model file "
               "(default: byte-tiny:all,byte-small:learned+alibi,gpt2-tiny:learned)",
    "schemes": "comma-separated schemes, or all, for configs without their own list (default all)",
    "precision": "comma-separated bf16-mixed and/or 32 (default bf16-mixed)",
    "compile": "comma-separated false and/or true (default false)",
    "rounds": "timed rounds (default 10)",
    "steps": "timed consecutive steps per path per round, after one untimed (default 4)",
    "warmup": "untimed steps per path first (default 2)",
    "batch_size": "sequences per step (default 16)",
    "block_size": "training length (default: the conf/model file's, 256)",
    "eval": "evaluation time and memory at eval_factor x the training length (default true)",
    "eval_factor": "comma-separated multiples of the training length (default 16); with several, every "
                   "evaluation runs one sequence and each row gets eval_curve and eval_mem_exponent",
    "memory": "peak training memory in a child process (default true)",
    "loop": "also time pelab's GPT (learned) in the reference's plain loop, path pelab-loop: splits "
            "pelab vs the reference into the model and the Lightning loop (default true)",
    "device": "cpu or cuda (default: cuda when available)",
    "out": "also write the JSON lines to this file",
    "smoke": "true: byte-tiny, learned+alibi, 2 steps, 1 round, eager, batch 4, eval at 2x (the test suite's run)",
}

VOCABS = {"byte": (256, 1), "gpt2": (50257, 64)}  # vocabulary, pad_vocab_multiple
# conf/callbacks/default.yaml entries left out of the timed fit: they write files or probe the
# model only at validation or at the end of training, none of which happens in the timed steps
NOT_TIMED_CALLBACKS = ("model_checkpoint", "attention_maps", "position_functions", "end_of_training")
EVAL_Q_CHUNK = 1024
PELAB_LOOP = "pelab-loop"  # path name: pelab's GPT in the reference's loop
EVAL_TOKENS_PER_BATCH = 4096


def truthy(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"expected true or false, got {value!r}")


# ---------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------

def model_config(config: str, block_size: int | None) -> dict:
    from omegaconf import OmegaConf

    vocab, _, size = config.partition("-")
    if vocab not in VOCABS or not (ROOT / "conf" / "model" / f"{size}.yaml").is_file():
        raise SystemExit(f"config {config!r}: expected VOCAB-SIZE with VOCAB in {sorted(VOCABS)} and SIZE a "
                         f"file of conf/model/")
    model = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{size}.yaml"), resolve=True)
    model["vocab_size"], model["pad_vocab_multiple"] = VOCABS[vocab]
    if block_size:
        model["block_size"] = block_size
    return model


def pe_config(scheme: str, **overrides) -> dict:
    """The scheme's conf/pe file (what train.py uses), or its class with defaults."""
    from omegaconf import OmegaConf

    from model.pe import SCHEMES

    path = ROOT / "conf" / "pe" / f"{scheme}.yaml"
    if path.is_file():
        pe = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    else:
        cls = SCHEMES[scheme]
        pe = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    return pe | overrides


def optim_config() -> dict:
    from omegaconf import OmegaConf

    optim = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "optim" / "adamw.yaml"), resolve=True)
    optim["warmup_steps"] = 10
    return optim


def trainer_defaults() -> dict:
    from omegaconf import OmegaConf

    t = OmegaConf.load(ROOT / "conf" / "trainer" / "default.yaml")
    return {"gradient_clip_val": t.gradient_clip_val, "log_every_n_steps": t.log_every_n_steps,
            "accumulate_grad_batches": t.accumulate_grad_batches}


def timed_callbacks() -> list:
    """conf/callbacks/default.yaml, instantiated, minus NOT_TIMED_CALLBACKS."""
    import hydra
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml")
    return [hydra.utils.instantiate(cfg[name]) for name in cfg if name not in NOT_TIMED_CALLBACKS]


# ---------------------------------------------------------------------------------------
# the independent reference: nanoGPT-style model and loop, no pelab code
# ---------------------------------------------------------------------------------------

def reference_model(model: dict):
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    C, H, T, p = model["n_embd"], model["n_head"], model["block_size"], model.get("dropout", 0.0)
    bias = model.get("bias", False)
    m = model.get("pad_vocab_multiple", 1)
    V = (model["vocab_size"] + m - 1) // m * m

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C, bias=bias), nn.Linear(C, C, bias=bias)
            self.resid = nn.Dropout(p)

        def forward(self, x):
            B, T_, _ = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p if self.training else 0.0, is_causal=True)
            return self.resid(self.c_proj(y.transpose(1, 2).contiguous().view(B, T_, C)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C, bias=bias), nn.LayerNorm(C, bias=bias)
            self.attn = Attention()
            self.mlp = nn.Sequential(nn.Linear(C, 4 * C, bias=bias), nn.GELU(), nn.Linear(4 * C, C, bias=bias),
                                     nn.Dropout(p))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Reference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.drop = nn.Dropout(p)
            self.h = nn.ModuleList(Block() for _ in range(model["n_layer"]))
            self.ln_f = nn.LayerNorm(C, bias=bias)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.wte.weight = self.lm_head.weight
            for mod in self.modules():
                if isinstance(mod, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(mod.weight, 0.0, 0.02)
                    if getattr(mod, "bias", None) is not None:
                        nn.init.zeros_(mod.bias)
            for name, w in self.named_parameters():
                if name.endswith("2.weight") or name.endswith("c_proj.weight"):
                    nn.init.normal_(w, 0.0, 0.02 / math.sqrt(2 * model["n_layer"]))

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    return Reference()


def reference_optimizer(net, optim: dict, device: str, total_steps: int):
    import math

    import torch

    params = [p for p in net.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"],
                            fused=device == "cuda")
    lr, min_lr, warm = optim["lr"], optim["min_lr"], optim["warmup_steps"]

    def factor(step: int) -> float:  # linear warmup, cosine to min_lr
        if step < warm:
            return (step + 1) / (warm + 1)
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return (min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)) / lr

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def flops_per_token(net, model: dict) -> int:
    """LitGPT's formula (PaLM appendix B), for the reference."""
    n = sum(p.numel() for p in net.parameters())
    return 6 * n + 12 * model["n_layer"] * model["n_embd"] * model["block_size"]


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------

def batches(vocab_size: int, B: int, T: int, seed: int = 0):
    """A DataLoader of endless (x, y) batches cycling over 64 fixed random windows."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (64, T + 1), generator=g)

    class Windows(Dataset):
        def __len__(self) -> int:
            return 10**12

        def __getitem__(self, i: int):
            w = data[i % len(data)]
            return w[:-1], w[1:]

    return DataLoader(Windows(), batch_size=B, shuffle=False, num_workers=0)


# ---------------------------------------------------------------------------------------
# paths: each in its own process, one at a time
# ---------------------------------------------------------------------------------------

class Stop(Exception):
    pass


class StepClock:
    """The body's side of a path: ``begin()`` once before the first step, ``tick()`` at every
    step end. ``tick`` records the interval since the previous step end (or since ``begin``/
    the resume) in wall and process-CPU seconds, and at the end of a quota reports them over
    ``conn`` and waits for the next quota; it returns True when the body must stop."""

    def __init__(self, conn, sync) -> None:
        self.conn, self.sync = conn, sync
        self.times: list[tuple[float, float]] = []
        self._quota, self._last, self._last_cpu = 0, 0.0, 0.0

    def wait(self) -> bool:
        """Block until the parent sends the next quota; True means stop."""
        quota = self.conn.recv()
        if quota is None:
            return True
        self._quota = quota
        self._last, self._last_cpu = time.perf_counter(), time.process_time()
        return False

    def begin(self) -> None:
        self.sync()
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def tick(self) -> bool:
        self.sync()
        now, cpu = time.perf_counter(), time.process_time()
        self.times.append((now - self._last, cpu - self._last_cpu))
        self._last, self._last_cpu = now, cpu
        self._quota -= 1
        if self._quota > 0:
            return False
        self.conn.send(("steps", self.times))
        self.times = []
        return self.wait()


def _path_process(conn, kind: str, job: dict) -> None:
    """A path's process: build the model and its loop, report flops/token, then run quotas."""
    import torch

    quiet()
    torch.set_num_threads(job["nthreads"])
    device = job["device"]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    clock = StepClock(conn, sync)
    try:
        body, fpt = path_body(None if kind == "reference" else kind, job)
        conn.send(("ready", fpt))
        if not clock.wait():
            body(clock)
    except Stop:
        pass
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("done", None))


class Path_:
    """A training path in its own process (forked from the bench's fork server, so it trains
    in that process's main thread with its own allocator and OpenMP team, as a real run
    does), ``quota`` steps at a time on request: exactly one path runs at a time."""

    def __init__(self, name: str, kind: str, job: dict, children: "Children") -> None:
        self.name = name
        self.times: list[float] = []   # every interval, warm-up included
        self.cpu: list[float] = []     # this path's process CPU seconds over the same intervals
        self.rounds: list[list[float]] = []
        self.cpu_rounds: list[list[float]] = []
        self.conn, child_conn = children.ctx.Pipe()
        self.process = children.ctx.Process(target=_path_process, args=(child_conn, kind, job), name=name,
                                            daemon=True)
        self.process.start()
        child_conn.close()
        self.flops_per_token = self._receive("ready")

    def _receive(self, expected: str):
        try:
            what, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"path {self.name} died (exit code {self.process.exitcode})") from None
        if what == "error":
            raise RuntimeError(f"path {self.name} failed: {value}")
        if what != expected:
            raise RuntimeError(f"path {self.name} stopped early ({what})")
        return value

    def run(self, n: int, skip: int = 0, record: bool = True) -> None:
        """Run skip + n steps now (blocking); the last n are added to ``rounds`` (wall) and
        ``cpu_rounds`` (process CPU time)."""
        self.conn.send(skip + n)
        steps = self._receive("steps")
        self.times += [w for w, _ in steps]
        self.cpu += [c for _, c in steps]
        if record:
            self.rounds.append([w for w, _ in steps[skip:]])
            self.cpu_rounds.append([c for _, c in steps[skip:]])

    def finish(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
        self.conn.close()


def host_memory_setting() -> None:
    """conf/callbacks/default.yaml's ``host_memory_reuse`` (if there) applied to this process, as
    the Trainer applies it to pelab's paths: the plain loops then do not re-fault freed memory
    either, so the ratios compare code, not glibc's trimming (which made the reference's steps
    up to 1.4x slower at random)."""
    import hydra
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml")
    if "host_memory_reuse" in cfg:
        hydra.utils.instantiate(cfg["host_memory_reuse"]).setup(None, None, "fit")


def reference_body(model: dict, precision: str, compile_: bool, device: str, B: int, nthreads: int,
                   pelab_model: bool = False):
    """The reference loop, with the reference model or (``pelab_model``) pelab's GPT with
    learned positions, the LightningModule's model without the Lightning loop."""
    import torch

    host_memory_setting()
    torch.manual_seed(0)
    if pelab_model:
        lit = lit_module(model, "learned", False)
        net, fpt = pelab_loss_module(lit.model).to(device), lit.flops_per_token
    else:
        net = reference_model(model).to(device)
        fpt = flops_per_token(net, model)
    optim = optim_config()

    def body(path: StepClock) -> None:
        torch.set_num_threads(nthreads)
        run_net = torch.compile(net) if compile_ else net
        opt, sched = reference_optimizer(net, optim, device, 10**9)
        params = list(net.parameters())
        net.train()
        path.begin()
        for x, y in batches(model["vocab_size"], B, model["block_size"]):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = run_net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if path.tick():
                return

    return body, fpt


def pelab_loss_module(gpt):
    """pelab's GPT as the reference loop calls its model: net(x, y) -> loss."""
    from torch import nn

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt

        def forward(self, idx, targets):
            return self.gpt(idx, targets)[1]

    return Loss()


def lit_module(model: dict, scheme: str, compile_: bool, **pe_overrides):
    import torch

    from model.lit import LitGPT

    torch.manual_seed(0)
    return LitGPT(model=model, pe=pe_config(scheme, **pe_overrides), optim=optim_config(), compile=compile_)


def lightning_trainer(precision: str, device: str, callbacks: list, max_steps: int = 10**9):
    import lightning as L

    return L.Trainer(max_steps=max_steps, accelerator=device, devices=1, precision=precision, logger=False,
                     callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                     default_root_dir="/tmp/pelab-bench", **trainer_defaults())


def pelab_body(model: dict, scheme: str, precision: str, compile_: bool, device: str, B: int, nthreads: int):
    import lightning as L
    import torch

    lit = lit_module(model, scheme, compile_)

    class StepTimer(L.Callback):
        """Last in the list: a step ends after every other callback's on_train_batch_end."""

        def __init__(self, path: StepClock) -> None:
            self.path = path

        def on_train_start(self, trainer, pl_module) -> None:
            self.path.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.path.tick():
                raise Stop

    def body(path: StepClock) -> None:
        torch.set_num_threads(nthreads)
        trainer = lightning_trainer(precision, device, timed_callbacks() + [StepTimer(path)])
        trainer.fit(lit, train_dataloaders=batches(model["vocab_size"], B, model["block_size"]))

    return body, lit.flops_per_token


def path_body(scheme: str | None, job: dict):
    """(body, flops per token) of the reference loop (``scheme`` None), of pelab's model in it
    (``scheme`` PELAB_LOOP) or of pelab with ``scheme``."""
    if scheme is None or scheme == PELAB_LOOP:
        return reference_body(job["model"], job["precision"], job["compile"], job["device"], job["B"],
                              job["nthreads"], pelab_model=scheme == PELAB_LOOP)
    return pelab_body(job["model"], scheme, job["precision"], job["compile"], job["device"], job["B"],
                      job["nthreads"])


# ---------------------------------------------------------------------------------------
# peak memory and evaluation, each in a fresh child
# ---------------------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_start(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return _rss_bytes()


def _peak_mb(device: str, start: float) -> float:
    import resource

    import torch

    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start) / 2**20


def child_train_memory(job: dict) -> dict:
    """Peak memory of a few training steps of one path (fresh child)."""
    import torch

    torch.set_num_threads(job["nthreads"])
    device, steps = job["device"], 3
    start = _peak_start(device)
    holder = {}

    class Steps:  # no baton: run `steps` steps and stop
        def begin(self) -> None:
            pass

        def tick(self) -> bool:
            holder["n"] = holder.get("n", 0) + 1
            if holder["n"] >= steps:
                if job["scheme"] is None:
                    return True
                raise Stop
            return False

    path = Steps()
    body, _ = path_body(job["scheme"], job)

    try:
        body(path)
    except Stop:
        pass
    return {"peak_mem_mb": _peak_mb(device, start)}


def child_eval(job: dict) -> dict:
    """Time and peak memory of GPT.token_nll at eval_factor x the training length (fresh child)."""
    import torch

    torch.set_num_threads(job["nthreads"])
    device, model = job["device"], job["model"]
    L_eval = model["block_size"] * job["eval_factor"]
    start = _peak_start(device)
    overrides = {"max_positions": L_eval} if job["scheme"] == "learned" else {}
    gpt = lit_module(model, job["scheme"], False, **overrides).model.to(device).eval()
    batch = job.get("eval_batch") or max(1, EVAL_TOKENS_PER_BATCH // L_eval)
    g = torch.Generator().manual_seed(1)
    xy = torch.randint(0, model["vocab_size"], (batch, L_eval + 1), generator=g).to(device)
    times = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16,
                                             enabled=job["precision"] == "bf16-mixed"):
            nll = gpt.token_nll(xy[:, :-1], xy[:, 1:], q_chunk=EVAL_Q_CHUNK)
        float(nll.sum())
        times.append(time.perf_counter() - t0)
    return {"eval_s_16x": statistics.median(times[1:]), "eval_peak_mem_mb_16x": _peak_mb(device, start),
            "eval_length": L_eval, "eval_batch": batch}


def quiet() -> None:
    """No lightning banners or warnings (after lightning's import, which sets its levels)."""
    import logging
    import warnings

    import lightning  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _child(kind: str, job: dict):
    quiet()
    return child_eval(job) if kind == "eval" else child_train_memory(job)


class Children:
    """Fresh processes forked from a server that has imported torch and lightning but computed
    nothing, so each child's peak RSS starts at its import footprint and its OpenMP is fresh."""

    def __init__(self) -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "lightning", "model.lit"])

    def run(self, kind: str, job: dict) -> dict:
        with self.ctx.Pool(1, maxtasksperchild=1) as pool:
            return pool.apply(_child, (kind, job))


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------

def peak_flops(device: str, precision: str) -> tuple[float, str]:
    import torch

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    if device == "cuda":
        from lightning.fabric.utilities.throughput import get_available_flops

        flops = get_available_flops(torch.device("cuda"), dtype)
        if flops:
            return float(flops), "lightning table of the device's peak"
    n, trials = 2048, 12
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    (a @ b).sum().item()  # first call: kernel selection, page faults
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, f"measured: best of {trials} {n}^3 {str(dtype).removeprefix('torch.')} matmuls on {device}"


def round_ratios(num: list[list[float]], den: list[list[float]]) -> list[float]:
    """min(num's round) / min(den's round) per round. With step times, called as (other, this):
    this path's tokens/s / the other's, paired round by round."""
    return [min(a) / min(b) for a, b in zip(num, den)]


def median_of_ratios(num: list[list[float]], den: list[list[float]]) -> float:
    return statistics.median(round_ratios(num, den))


def median_ci95(values: list[float]) -> list[float] | None:
    """Distribution-free confidence interval (>= 95%) of the median: the order statistics
    x_(k), x_(n+1-k) with k the largest such that P(Binomial(n, 1/2) < k) <= 2.5%. None below 6
    values (no such k exists)."""
    n = len(values)
    tail, k = 0.0, 0  # tail = P(Binomial(n, 1/2) <= k - 1)
    while tail + math.comb(n, k) / 2**n <= 0.025:
        tail += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    xs = sorted(values)
    return [round(xs[k - 1], 4), round(xs[n - k], 4)]


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def bench_group(cfg: str, schemes: list[str], precision: str, compiles: list[bool], opts: dict, children
                ) -> list[dict]:
    """Time every path of one config and precision, eager and compiled interleaved in the same
    rounds (so ``ratio_vs_eager`` is paired like the other ratios); rows per compile setting."""
    import torch

    model = model_config(cfg, opts["block_size"])
    device, B = opts["device"], opts["batch_size"]
    nthreads = torch.get_num_threads()
    paths: dict[tuple[str, bool], Path_] = {}
    try:
        for compile_ in compiles:
            job = {"model": model, "precision": precision, "compile": compile_, "device": device, "B": B,
                   "nthreads": nthreads}
            for name in ["reference", *([PELAB_LOOP] if opts["loop"] else []), *schemes]:
                paths[name, compile_] = Path_(f"{name}{'+compile' if compile_ else ''}", name, job, children)
        load_start = load1()
        order = list(paths)
        for p in order:
            paths[p].run(opts["warmup"], record=False)
        for r in range(opts["rounds"]):
            # every path at every place of the order in turn; the first step after a switch
            # (other processes' data in the caches, this one's OpenMP team asleep) is not timed
            turn = order[r % len(order):] + order[: r % len(order)]
            for p in (turn if r % 2 == 0 else turn[::-1]):
                paths[p].run(opts["steps"], skip=1)
    finally:
        for p in paths.values():
            p.finish()
    load_end = load1()
    peak, peak_source = opts["peaks"][precision]
    rows = []
    for compile_ in compiles:
        group = {name: p for (name, c), p in paths.items() if c == compile_}
        eager = {name: p for (name, c), p in paths.items() if not c} if compile_ and False in compiles else {}
        rows += group_rows(cfg, model, precision, compile_, group, eager, opts, load_start, load_end, peak,
                           peak_source, children)
    return rows


def group_rows(cfg: str, model: dict, precision: str, compile_: bool, paths: dict, eager: dict, opts: dict,
               load_start: float, load_end: float, peak: float, peak_source: str, children) -> list[dict]:
    """The rows of one compile setting's paths (``eager``: the same paths uncompiled, or {})."""
    import torch

    device, B, T = opts["device"], opts["batch_size"], model["block_size"]
    nthreads = torch.get_num_threads()
    rows = []
    ref = paths["reference"]
    learned = paths.get("learned")
    for name, p in paths.items():
        plain_loop = name in ("reference", PELAB_LOOP)  # the reference's loop, learned positions
        vs_reference = name in ("learned", PELAB_LOOP)  # the rows compared with the reference
        step = statistics.median(min(r) for r in p.rounds)  # see the module docstring
        all_steps = statistics.median(t for r in p.rounds for t in r)
        row = {"config": cfg, "scheme": "learned" if plain_loop else name,
               "path": name if plain_loop else "pelab", "precision": precision,
               "compile": compile_, "device": device, "batch_size": B, "block_size": T,
               "step_ms": round(step * 1000, 2), "step_ms_all_median": round(all_steps * 1000, 2), "tokens_per_s": round(B * T / step, 1)}
        # step-time ratio other/this = tokens/s ratio this/other
        against = {"reference": ref if vs_reference else None,
                   "learned": learned if not plain_loop else None,
                   "eager": eager.get(name)}  # compiled tokens/s / eager tokens/s of the same path
        for what, other in against.items():
            ratios = round_ratios(other.rounds, p.rounds) if other is not None else None
            row[f"ratio_vs_{what}"] = round(statistics.median(ratios), 4) if ratios else None
            row[f"ratio_vs_{what}_ci95"] = median_ci95(ratios) if ratios and other is not p else None
        if name == "reference":
            row["ratio_vs_reference"] = 1.0
        # the same from the process's CPU time per step (less sensitive to other processes)
        row["cpu_ms"] = round(statistics.median(min(r) for r in p.cpu_rounds) * 1000, 2)
        row["ratio_vs_reference_cpu"] = (1.0 if name == "reference" else
                                         round(median_of_ratios(ref.cpu_rounds, p.cpu_rounds), 4)
                                         if vs_reference else None)
        row["ratio_vs_learned_cpu"] = (round(median_of_ratios(learned.cpu_rounds, p.cpu_rounds), 4)
                                       if learned is not None and not plain_loop else None)
        warm = p.times[: opts["warmup"]]
        row["compile_s"] = round(sum(warm) - len(warm) * step, 2) if compile_ else None
        row["flops_per_token"] = p.flops_per_token
        row["mfu"] = round(p.flops_per_token * B * T / step / peak, 4)
        row["peak_tflops"], row["peak_source"] = round(peak / 1e12, 3), peak_source
        row["load_avg"] = [load_start, load_end]
        row["rounds_ms"] = [[round(t * 1000, 1) for t in r] for r in p.rounds]  # every timed step, by round
        rows.append(row)

    for row in rows:
        scheme = None if row["path"] == "reference" else row["scheme"]
        job = {"model": model, "scheme": scheme, "precision": precision, "compile": compile_, "device": device,
               "B": B, "nthreads": nthreads}
        measured = opts["memory"] and row["path"] != PELAB_LOOP  # the pelab row has the model's memory
        row["peak_mem_mb"] = round(children.run("memory", job)["peak_mem_mb"], 1) if measured else None
        row["peak_mem_method"] = ("cuda max_memory_allocated" if device == "cuda" else
                                  "cpu peak RSS rise (getrusage ru_maxrss) in a forked child") if measured else None
        row["eval_s_16x"] = row["eval_peak_mem_mb_16x"] = row["eval_length"] = None
        if opts["eval"] and row["path"] == "pelab":
            factors = opts["eval_factors"]
            curve = []
            batch = 1 if len(factors) > 1 else None  # a memory curve compares lengths alone
            for factor in factors:
                key = (cfg, scheme, precision, factor, batch)
                if key not in opts["eval_cache"]:
                    opts["eval_cache"][key] = children.run("eval", job | {"eval_factor": factor, "eval_batch": batch})
                curve.append(opts["eval_cache"][key])
            main = next((ev for f, ev in zip(factors, curve) if f == 16), curve[-1])
            row["eval_s_16x"] = round(main["eval_s_16x"], 3)
            row["eval_peak_mem_mb_16x"] = round(main["eval_peak_mem_mb_16x"], 1)
            row["eval_length"] = main["eval_length"]
            if len(curve) > 1:
                row["eval_curve"] = [{"length": ev["eval_length"], "batch": ev["eval_batch"],
                                      "s": round(ev["eval_s_16x"], 3), "peak_mb": round(ev["eval_peak_mem_mb_16x"], 1)}
                                     for ev in curve]
                row["eval_mem_exponent"] = round(growth_exponent(
                    [ev["eval_length"] for ev in curve], [ev["eval_peak_mem_mb_16x"] for ev in curve]), 3)
    return rows


def growth_exponent(lengths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(length): 1 for memory linear in the
    length, 2 for quadratic."""
    xs, ys = [math.log(x) for x in lengths], [math.log(max(y, 1e-9)) for y in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def fmt_ratio(row: dict, what: str) -> str:
    """The ratio with its 95% interval, e.g. ``0.983 (0.951-1.004)``."""
    ci = row.get(f"ratio_vs_{what}_ci95")
    return fmt(row[f"ratio_vs_{what}"], ".3f") + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


def print_table(rows: list[dict]) -> None:
    print("| config | precision | compile | scheme | path | ms/step | tokens/s | vs reference | vs learned "
          "| vs eager | MFU | peak MB | compile s | eval 16x s | eval 16x MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['precision']} | {str(r['compile']).lower()} | {r['scheme']} | {r['path']} "
              f"| {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {fmt_ratio(r, 'reference')} "
              f"| {fmt_ratio(r, 'learned')} | {fmt_ratio(r, 'eager')} | {fmt(r['mfu'], '.3f')} "
              f"| {fmt(r['peak_mem_mb'], '.0f')} "
              f"| {fmt(r['compile_s'], '.1f')} | {fmt(r['eval_s_16x'], '.2f')} "
              f"| {fmt(r['eval_peak_mem_mb_16x'], '.0f')} |", flush=True)


DEFAULT_CONFIGS = "byte-tiny:all,byte-small:learned+alibi,gpt2-tiny:learned"


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    smoke = truthy(args.get("smoke", "false"))
    if smoke:
        args = {"configs": "byte-tiny", "schemes": "learned,alibi", "precision": "bf16-mixed", "compile": "false",
                "rounds": "1", "steps": "2", "warmup": "1", "batch_size": "4", "eval_factor": "2"} | args
    import torch

    from model.pe import SCHEMES

    quiet()

    def schemes_of(spec: str) -> list[str]:
        names = sorted(SCHEMES) if spec == "all" else spec.split("+") if "+" in spec else split_list(spec)
        names = sorted(set(names), key=lambda s: (s != "learned", s))  # learned first
        unknown = [s for s in names if s not in SCHEMES]
        if unknown:
            raise SystemExit(f"unknown schemes {unknown}; registered: {', '.join(sorted(SCHEMES))}")
        return names

    default_schemes = args.get("schemes", "all")
    configs = []
    for item in split_list(args.get("configs", DEFAULT_CONFIGS)):
        cfg, _, own = item.partition(":")
        if own and "schemes" not in args:
            configs.append((cfg, schemes_of(own)))
        else:
            configs.append((cfg, schemes_of(",".join(split_list(default_schemes))) if default_schemes != "all"
                            else schemes_of("all")))
    precisions = [{"bf16": "bf16-mixed", "32-true": "32", "fp32": "32"}.get(p, p)
                  for p in split_list(args.get("precision", "bf16-mixed"))]
    for p in precisions:
        if p not in ("bf16-mixed", "32"):
            raise SystemExit(f"precision {p!r}: expected bf16-mixed or 32")
    compiles = sorted({truthy(c) for c in split_list(args.get("compile", "false"))})  # eager first
    opts = {"rounds": int(args.get("rounds", 10)), "steps": int(args.get("steps", 4)),
            "warmup": int(args.get("warmup", 2)), "batch_size": int(args.get("batch_size", 16)),
            "block_size": int(args["block_size"]) if "block_size" in args else None,
            "eval": truthy(args.get("eval", "true")),
            "eval_factors": [int(f) for f in split_list(str(args.get("eval_factor", 16)))],
            "memory": truthy(args.get("memory", "true")),
            "loop": truthy(args.get("loop", "true")),
            "device": args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"), "eval_cache": {}}
    if opts["rounds"] < 1 or opts["steps"] < 1 or opts["warmup"] < 1:
        raise SystemExit("rounds, steps and warmup must be >= 1")
    # the matmul peak is measured once, first, on the quiet machine (measured after a group's
    # timing it once came out at half the usual value)
    opts["peaks"] = {p: peak_flops(opts["device"], p) for p in precisions}
    children = Children()
    out = open(args["out"], "w") if "out" in args else None  # noqa: SIM115
    print(f"[bench] device={opts['device']} threads={torch.get_num_threads()} batch={opts['batch_size']} "
          f"rounds={opts['rounds']} steps={opts['steps']} warmup={opts['warmup']} load={os.getloadavg()}",
          flush=True)
    rows = []
    try:
        for cfg, schemes in configs:
            for precision in precisions:
                t0 = time.perf_counter()
                group = bench_group(cfg, schemes, precision, compiles, opts, children)
                print(f"[bench] {cfg} {precision} compile={','.join(str(c) for c in compiles)}: "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                for row in group:
                    line = json.dumps(row)
                    print("BENCH_JSON " + line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
                rows += group
    finally:
        if out:
            out.close()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
