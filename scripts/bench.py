"""Training-step benchmark: the Lightning path against a plain PyTorch loop, side by side.

    python scripts/bench.py                          # tiny model, every scheme, CPU or GPU
    python scripts/bench.py schemes=rope,alibi steps=50 batch_size=16 block_size=256

For each scheme, in one process and on the same batches: median ms per optimisation step of
(a) a plain loop (autocast forward, backward, clip, AdamW, LR schedule), (b) LitGPT under the
Lightning Trainer with pelab's default callbacks, and (c) the same plus the attention-map
callback firing at every validation. Medians over `steps` (after `warmup`), runs interleaved
`repeats` times; ratios are (b)/(a) and (c)/(b). Speed targets live here, never in tests.
"""

from __future__ import annotations

import statistics
import sys
import time

from _common import parse_key_values, split_list

OPTIONS = {
    "schemes": "comma-separated schemes (default: all)",
    "steps": "timed steps per measurement (default 30)",
    "warmup": "untimed steps first (default 5)",
    "repeats": "interleaved repeats of the three measurements (default 3)",
    "batch_size": "sequences per step (default 16)",
    "block_size": "tokens per sequence (default 256)",
    "n_layer": "default 4", "n_head": "default 4", "n_embd": "default 128",
    "vocab_size": "default 256",
    "device": "cpu or cuda (default: cuda when available)",
}


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset

    from evaluation.attention_maps import AttentionMaps
    from model.callbacks import TokensPerSecond
    from model.lit import LitGPT
    from model.pe import SCHEMES

    schemes = split_list(args["schemes"]) if "schemes" in args else sorted(SCHEMES)
    steps, warmup, repeats = int(args.get("steps", 30)), int(args.get("warmup", 5)), int(args.get("repeats", 3))
    B, T = int(args.get("batch_size", 16)), int(args.get("block_size", 256))
    model = {"vocab_size": int(args.get("vocab_size", 256)), "block_size": T, "n_layer": int(args.get("n_layer", 4)),
             "n_head": int(args.get("n_head", 4)), "n_embd": int(args.get("n_embd", 128))}
    device = args.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    optim = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10}

    class Windows(Dataset):  # fixed random batches, identical for every path
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.data = torch.randint(0, model["vocab_size"], (n, T + 1), generator=g)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int):
            return self.data[i, :-1], self.data[i, 1:]

    total = warmup + steps
    data = Windows(total * B)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def plain(scheme: str) -> float:
        torch.manual_seed(0)
        lit = LitGPT(model=model, pe={"_target_": f"{SCHEMES[scheme].__module__}.{SCHEMES[scheme].__name__}"}, optim=optim)
        gpt = lit.model.to(device).train()
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3, fused=device == "cuda")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lit.optim.lr_at(s, total) / lit.optim.lr)
        stamps = []
        for x, y in DataLoader(data, batch_size=B):
            sync()
            stamps.append(time.perf_counter())  # batch start to batch start: loader included
            x, y = x.to(device), y.to(device)
            with torch.autocast(device, dtype=torch.bfloat16):
                _, loss = gpt(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        return statistics.median([b - a for a, b in zip(stamps, stamps[1:])][warmup:])

    class StepTimer(L.Callback):
        """Batch start to batch start, as in the plain loop; intervals with a validation are dropped."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._last: float | None = None
            self._validated = False

        def on_train_batch_start(self, *a) -> None:
            sync()
            now = time.perf_counter()
            if self._last is not None and not self._validated:
                self.times.append(now - self._last)
            self._last, self._validated = now, False

        def on_validation_start(self, *a) -> None:
            self._validated = True

    def lightning(scheme: str, attention_maps: bool) -> float:
        torch.manual_seed(0)
        lit = LitGPT(model=model, pe={"_target_": f"{SCHEMES[scheme].__module__}.{SCHEMES[scheme].__name__}"}, optim=optim)
        timer = StepTimer()
        callbacks = [TokensPerSecond(), timer]
        if attention_maps:
            callbacks.append(AttentionMaps(every_n_validations=1, output_subdir="bench-attention"))
        trainer = L.Trainer(max_steps=total, accelerator=device, devices=1, precision="bf16-mixed", logger=False,
                            callbacks=callbacks,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=1.0, val_check_interval=10, limit_val_batches=1,
                            num_sanity_val_steps=0, default_root_dir="/tmp/pelab-bench")
        trainer.fit(lit, DataLoader(data, batch_size=B), DataLoader(Windows(B), batch_size=B))
        return statistics.median(timer.times[warmup:])

    print(f"device={device} model={model} batch={B}x{T} steps={steps} repeats={repeats} (median ms/step)")
    print("| scheme | plain loop | Lightning | Lightning/plain | + attention maps | maps/Lightning |")
    print("|---|---|---|---|---|---|")
    for scheme in schemes:
        runs = {"plain": [], "lightning": [], "maps": []}
        for _ in range(repeats):
            runs["plain"].append(plain(scheme))
            runs["lightning"].append(lightning(scheme, attention_maps=False))
            runs["maps"].append(lightning(scheme, attention_maps=True))
        p, l, m = (statistics.median(runs[k]) * 1000 for k in ("plain", "lightning", "maps"))
        print(f"| {scheme} | {p:.1f} | {l:.1f} | {l / p:.3f} | {m:.1f} | {m / l:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
