"""HostMemoryReuse: freed activation-sized blocks stay in the process (no page faults next step)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pelab.callbacks import HostMemoryReuse

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, BLOCK_MIB = 6, 8
PAGES = BLOCKS * BLOCK_MIB * 2**20 // os.sysconf("SC_PAGE_SIZE")

# One "training step" allocates and frees activation-sized blocks; the second step's minor
# page faults count the pages the C library gave back to the kernel after the first.
STEP_FAULTS = f"""
import resource, sys, torch
from pelab.callbacks import HostMemoryReuse
if sys.argv[1] == "on":
    callback = HostMemoryReuse()
    callback.setup(None, None, "fit")
    assert callback.applied
def step():
    blocks = [torch.empty({BLOCK_MIB} << 18).fill_(1.0) for _ in range({BLOCKS})]  # float32
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_step_faults(mode: str) -> int:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_are_reused_without_page_faults():
    control = second_step_faults("off")
    if control < PAGES * 2 // 3:
        pytest.skip(f"this C library kept the blocks by itself ({control} faults of {PAGES} pages)")
    tuned = second_step_faults("on")
    assert tuned < PAGES // 3, (tuned, control, PAGES)


@pytest.mark.parametrize("kwargs, key", [({"mmap_threshold_mb": 64}, "mmap_threshold_mb"),
                                         ({"mmap_threshold_mb": -1}, "mmap_threshold_mb"),
                                         ({"trim_threshold_mb": 1.5}, "trim_threshold_mb"),
                                         ({"trim_threshold_mb": True}, "trim_threshold_mb")])
def test_bad_thresholds_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=rf"callbacks\.host_memory_reuse\.{key} must be an integer in \[0, "):
        HostMemoryReuse(**kwargs)
