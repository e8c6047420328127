"""Run by tests/harness/test_fsdp.py, once per rank: FSDP on gloo CPU processes, configured by
Lightning's own ``FSDPStrategy.setup``/``_setup_model`` from conf/trainer/fsdp.yaml (Lightning
refuses FSDP without a GPU, so only ``device_id`` differs: the CPU instead of a CUDA index).
Autocast runs on the CPU in the dtype of the preset's ``trainer.precision``, as Lightning's FSDP
precision plugin runs it on CUDA. For every position scheme: the weight-decay groups before and
after wrapping, the dtypes of the buffers and the position terms inside a forward against an
unwrapped copy of the scheme, two optimizer steps through ``LitGPT.optimizer_step`` (which
projects constrained parameters) and the gathered parameters after them; for one scheme, the
validation of uneven window shards. Then sharded checkpoints through a Lightning ``Trainer`` with
the preset's strategy (``state_dict_type=sharded``): 4 steps saving every 2, a resume from step 2
to 4, a save that fails on a full disk. Rank zero writes the results as JSON (and the gathered
weights as OUT.pt).
    python tests/harness/fsdp_worker.py RANK WORLD STORE_FILE OUT.json"""

import copy
import gc
import datetime
import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.fsdp as fsdp  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
VAL_WINDOWS, VAL_BATCH = 5, 2  # 2 ranks: shares of 3 and 2 windows, 2 batches and 1 unpadded


class CPUDeviceFSDP(fsdp.FullyShardedDataParallel):
    """FSDP as Lightning builds it, with the CPU as its device (Lightning passes the CUDA index)."""

    def __init__(self, module, *args, device_id=None, **kwargs):
        super().__init__(module, *args, device_id=torch.device("cpu"), **kwargs)


class Windows(Dataset):
    def __init__(self, count: int) -> None:
        self.tokens = torch.randint(0, TINY["vocab_size"], (count, TINY["block_size"] + 1),
                                    generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def preset_strategy(rank: int, world: int):
    """conf/trainer/fsdp.yaml's strategy, set up as Lightning's connector sets it up."""
    import hydra
    from hydra import compose, initialize_config_dir
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.plugins.precision import FSDPPrecision

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=["trainer=fsdp"])
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    strategy.precision_plugin = FSDPPrecision(cfg.trainer.precision)
    environment = LightningEnvironment()
    environment.set_global_rank(rank)
    environment.set_world_size(world)
    os.environ["LOCAL_RANK"] = str(rank)
    strategy.cluster_environment = environment
    strategy.parallel_devices = [torch.device("cpu")] * world
    fsdp.FullyShardedDataParallel = CPUDeviceFSDP  # _setup_model imports it at each call
    return strategy, cfg.trainer.precision


def position_terms(pe) -> dict[str, torch.Tensor]:
    """Every position term the scheme gives a forward: embedding, rotation tables (also at far
    positions, where a rounded frequency shows), bias."""
    p, far = torch.arange(TINY["block_size"]), torch.arange(0, 16384, 512)
    terms = {}
    if pe.uses_embed:
        terms["embed"] = pe.embed(torch.zeros(1, len(p), TINY["n_embd"]), p)
    if pe.uses_rotate:
        for name, positions in (("near", p), ("far", far)):
            for field, table in pe.rotation_tables(positions, positions)._asdict().items():
                terms[f"rotation {name} {field}"] = table
    if pe.uses_bias:
        terms["bias"] = pe.bias(p, p)
    return terms


def decayed_names(module, optimizer) -> list[str]:
    from pelab.optim import plain_name

    names = {id(p): plain_name(n) for n, p in module.model.named_parameters()}
    return sorted(names[id(p)] for p in optimizer.param_groups[0]["params"])


def one_scheme(name: str, strategy, dtype: torch.dtype, validate: bool) -> dict:
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    from model.pe import SCHEMES, PositionEncoding
    from pelab.lit import LitGPT

    cls = SCHEMES[name]
    torch.manual_seed(0)
    lit = LitGPT(model=TINY, pe={"_target_": f"{cls.__module__}.{cls.__name__}"},
                 optim={"lr": 3.0, "min_lr": 3.0, "warmup_steps": 0})  # steps far enough to leave ranges
    lit.trainer = SimpleNamespace(max_steps=10, precision_plugin=strategy.precision_plugin)
    lit.configure_model()  # Lightning calls it before the strategy wraps the model
    out = {"decayed_before": decayed_names(lit, lit.configure_optimizers()["optimizer"])}
    reference = copy.deepcopy(lit.model.pe)
    if validate:  # the single-process validation loss, before wrapping
        x, y = Windows(VAL_WINDOWS)[:]
        with torch.no_grad():
            _, loss = lit.model(x, y)
        out["val_loss_one_process"] = float(loss)

    wrapped = strategy._setup_model(strategy.precision_plugin.convert_module(lit))  # FSDPStrategy.setup's order
    out["root_unit"] = type(wrapped).__name__
    optimizer = lit.configure_optimizers()["optimizer"]  # Lightning: after wrapping
    out["decayed_after"] = decayed_names(lit, optimizer)

    seen = {}

    def inside_forward(module, args):  # the root unit's parameters are gathered here
        if not seen:
            seen["buffers"] = {n: str(b.dtype).removeprefix("torch.") for n, b in lit.model.named_buffers()}
            with torch.no_grad():
                ours, theirs = position_terms(lit.model.pe), position_terms(reference)
            seen["terms"] = {k: [str(v.dtype).removeprefix("torch."), bool(torch.equal(v, theirs[k]))]
                             for k, v in ours.items()}

    lit.model.blocks[0].register_forward_pre_hook(inside_forward)
    if validate:  # Lightning's validation loop: validation_step through the FSDP root's forward
        from pelab.datamodule import StreamDataModule

        data = StreamDataModule()
        data.val_set, data.val_batch_size, data.num_workers = Windows(VAL_WINDOWS), VAL_BATCH, 0
        data.trainer = SimpleNamespace(global_rank=dist.get_rank(), world_size=dist.get_world_size())
        with torch.no_grad():
            for i, batch in enumerate(data.val_dataloader()):
                _ForwardRedirection()(wrapped, lit, "validation_step", batch, i)
        out["val_loss"] = float(lit.val_loss.compute())  # torchmetrics reduces across the ranks
    x = torch.randint(0, TINY["vocab_size"], (2, TINY["block_size"] + 1), generator=torch.Generator().manual_seed(2))
    losses = []

    def closure():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            _, loss = wrapped(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        return loss

    for step in range(2):
        lit.optimizer_step(0, step, optimizer, closure)  # project() after the step, as in training
    out.update(seen, losses=losses)
    with fsdp.FullyShardedDataParallel.summon_full_params(wrapped):
        gathered = {n: p.detach().clone() for n, p in lit.model.pe.named_parameters()}
    out["pe_parameters"] = {n: p.tolist() for n, p in gathered.items()}
    out["finite"] = all(bool(p.isfinite().all()) for p in gathered.values())
    if type(reference).project is not PositionEncoding.project:  # projecting again changes nothing
        reference.load_state_dict(gathered, strict=False)
        reference.project()
        out["in_range"] = all(torch.equal(p, gathered[n]) for n, p in reference.named_parameters())
    return out


class Stream(Dataset):
    """Sample i of a rank's stream: a window drawn from (rank, offset + i)."""

    def __init__(self, rank: int, offset: int) -> None:
        self.rank, self.offset = rank, offset

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 * self.rank + self.offset + i)
        x = torch.randint(0, TINY["vocab_size"], (TINY["block_size"] + 1,), generator=g)
        return x[:-1], x[1:]


def stream_loader(trainer, batch_size: int = 2):
    """pelab's data position (pelab/datamodule.py): a run continues its rank's stream after the
    samples of the steps it starts from (the resumed global step)."""
    from torch.utils.data import DataLoader

    return DataLoader(Stream(trainer.global_rank, trainer.global_step * batch_size), batch_size=batch_size)


class Record(__import__("lightning").Callback):
    """The loss and learning rate of every step, and each rank's shards and AdamW state at the end."""

    def __init__(self) -> None:
        self.steps: dict[int, list[float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.steps[trainer.global_step] = [float(outputs["loss"]), lr, float(batch[0].float().sum())]

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        self.shards = [p.detach().clone() for p in trainer.strategy.model.parameters()]
        self.moments = [optimizer.state[p][k].clone() for group in optimizer.param_groups for p in group["params"]
                        for k in sorted(optimizer.state[p])]  # exp_avg, exp_avg_sq, step of each parameter


def fit(strategy_kwargs: dict, out: Path, ckpt_path=None, seed: int = 0):
    """A Lightning fit of the tiny model under the preset's FSDP strategy (float32: exact)."""
    import hydra
    import lightning as L
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pelab.lit import LitGPT

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose("config", overrides=["trainer=fsdp"])
    strategy = hydra.utils.instantiate(cfg.trainer.strategy, **strategy_kwargs)
    strategy.cpu_for_tests = True  # (and CPUDeviceFSDP: the CPU as FSDP's device)
    data = L.LightningDataModule()
    data.train_dataloader = lambda: stream_loader(data.trainer)
    torch.manual_seed(seed)
    lit = LitGPT(model=TINY, pe={"_target_": "model.pe.rope.RoPE"},
                 optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "decay_steps": 4})
    record = Record()
    saves = ModelCheckpoint(dirpath=out, filename="step{step}", auto_insert_metric_name=False, save_top_k=-1,
                            every_n_train_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision="32-true",
                        max_steps=4, limit_val_batches=0, num_sanity_val_steps=0, logger=False, gradient_clip_val=1.0,
                        use_distributed_sampler=False,  # as conf/trainer/default.yaml: each rank its own stream
                        callbacks=[record, saves], enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    trainer.fit(lit, datamodule=data, ckpt_path=ckpt_path)
    return trainer, record


def sharded_checkpoints(out: Path) -> dict:
    import errno
    import unittest.mock

    from lightning.fabric.strategies import fsdp as fabric_fsdp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = dist.get_rank()
    trainer, whole = fit({"state_dict_type": "sharded"}, out)
    result = {"state_dict_type": trainer.strategy.state_dict_type,
              "saved": sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())}
    from pelab.optim import plain_name

    with FSDP.summon_full_params(trainer.strategy.model):  # names without the wrappers' components
        gathered = {f"model.{plain_name(n)}": p.detach().clone()
                    for n, p in trainer.lightning_module.model.named_parameters()}
    _, resumed = fit({"state_dict_type": "sharded"}, out / "resumed", ckpt_path=out / "step2.ckpt", seed=1)
    same = [all(torch.equal(a, b) for a, b in zip(x, y)) and len(x) == len(y)
            for x, y in ((whole.shards, resumed.shards), (whole.moments, resumed.moments))]
    flags = torch.tensor(same, dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank's shards
    result.update(steps_whole=whole.steps, steps_resumed=resumed.steps, shards_equal=bool(flags[0]),
                  moments_equal=bool(flags[1]), moments=len(whole.moments))

    def full_disk(state, path):  # some bytes written, then the device is full (on every rank, as DCP reports)
        (Path(path) / f"__{rank}_0.distcp").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with unittest.mock.patch.object(fabric_fsdp, "_distributed_checkpoint_save", full_disk), \
            unittest.mock.patch("lightning.pytorch.strategies.fsdp._distributed_checkpoint_save", full_disk):
        try:
            trainer.save_checkpoint(out / "step4.ckpt")
            result["full_disk"] = "no error"
        except Exception as err:  # noqa: BLE001
            result["full_disk"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    result["after_full_disk"] = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
    if rank == 0:
        torch.save(gathered, out / "gathered.pt")
    return result


def main(rank: int, world: int, store: str, path: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    from model.pe import SCHEMES
    from pelab.lit import COMPUTE_DTYPES

    strategy, precision = preset_strategy(rank, world)
    dtype = COMPUTE_DTYPES[precision.split("-")[0]]
    results = {"mixed_precision": repr(strategy.mixed_precision_config), "precision": precision}
    for name in sorted(SCHEMES):
        try:  # every rank fails alike (same code, same seeds), so they stay in step
            results[name] = one_scheme(name, strategy, dtype, validate=name == "rope")
        except Exception as err:  # noqa: BLE001
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    ckpt_dir = path.parent / "sharded"
    try:
        results["sharded"] = sharded_checkpoints(ckpt_dir)
    except Exception as err:  # noqa: BLE001
        results["sharded"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    if rank == 0:
        path.write_text(json.dumps(results, indent=1))
    gc.collect()  # the wrapped models hold the process group: free them first
    dist.barrier()
    dist.destroy_process_group()  # stop gloo's threads before exit: left running, they can abort it


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
