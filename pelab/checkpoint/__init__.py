"""Checkpoints that survive faults, one idea a module (the names below are the package's API):

- ``atomic``: ``AtomicCheckpointIO``, the Trainer's CheckpointIO plugin (conf/trainer/default.yaml):
  a save goes to a hidden temporary file beside the target, is fsynced, then renamed over it.
- ``sharded``: ``FSDPStrategy`` (conf/trainer/fsdp.yaml, hsdp.yaml), Lightning's with
  ``state_dict_type=auto``, sharded (torch.distributed.checkpoint) directories renamed into place
  when complete, and the optimizer state resumed in each rank's own layout (any rank count, HSDP).
- ``async_save``: ``AsyncSaves``, sharded saves written beside training (``async_save=true``).
- ``mesh``: hybrid sharding's ``(replicas, shards)`` device mesh, checked against the world.
- ``read``: ``read_checkpoint`` opens a file or a sharded directory as a pelab checkpoint or raises
  ``CheckpointError`` naming the file and what is wrong; ``verify=True`` checks every CRC-32.
- ``compare``: the ``pe``/``model`` settings that differ between a checkpoint and a run.
- ``resume``: ``check_resume`` (``ckpt_path=`` against the run's config, before any data or
  compute) and ``resume_from_run_dir`` (``resume=auto``: the newest intact checkpoint of the run dir).
- ``init_from``: ``check_init_from`` / ``init_state`` / ``load_init_weights`` for ``init_from=``.
- ``tokenizer``: ``tokenizer_record`` (the tokenizer's fingerprint every checkpoint keeps) and
  ``check_tokenizer`` (refused where it no longer matches: resume, init_from, the scripts).
- ``load``: ``load_lit_gpt`` for the scripts (checked, ``weights_only=True``; a sharded directory
  gathered on the one CPU process) and ``consolidate`` (a sharded directory as one file).
"""

from pelab.checkpoint.atomic import AtomicCheckpointIO, atomic_torch_save, disk_full_error
from pelab.checkpoint.compare import config_mismatches
from pelab.checkpoint.errors import CheckpointError
from pelab.checkpoint.init_from import INIT_FREE, check_init_from, init_state, load_init_weights, refuse_non_finite_init
from pelab.checkpoint.load import consolidate, load_lit_gpt
from pelab.checkpoint.read import EXPECTED, read_checkpoint, verified
from pelab.checkpoint.resume import check_resume, checkpoints_newest_first, resume_from_run_dir
from pelab.checkpoint.sharded import (
    SHARDED_ABOVE_BYTES, FSDPStrategy, auto_state_dict_type, replace_dir, sharded_complete, sharded_state)
from pelab.checkpoint.tokenizer import check_tokenizer, tokenizer_record

__all__ = [
    "EXPECTED", "INIT_FREE", "SHARDED_ABOVE_BYTES", "AtomicCheckpointIO", "CheckpointError", "FSDPStrategy",
    "atomic_torch_save", "auto_state_dict_type", "check_init_from", "check_resume", "check_tokenizer",
    "checkpoints_newest_first",
    "config_mismatches", "consolidate", "disk_full_error", "init_state", "load_init_weights", "load_lit_gpt",
    "read_checkpoint", "refuse_non_finite_init", "replace_dir", "resume_from_run_dir", "sharded_complete",
    "sharded_state", "tokenizer_record", "verified",
]
