"""Hybrid sharding's device mesh (conf/trainer/hsdp.yaml): ``(replicas, shards)``, by default
``(trainer.num_nodes, trainer.devices)``: each node holds one full copy of the state, sharded
over its own GPUs (gathers stay on the node's fast links), and gradients are reduced across the
copies. Checked against the world before any data is read, built on the device type training
runs on (Lightning builds it on CUDA only)."""

from __future__ import annotations

from typing import Any

KEY = "trainer.strategy.device_mesh"


def mesh_shape(mesh: Any) -> tuple[int, int] | None:
    """A ``[replicas, shards]`` list (YAML, a ListConfig) as a tuple; None stays None."""
    if mesh is None:
        return None
    values = [mesh] if isinstance(mesh, (str, int)) else list(mesh)
    if len(values) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError(f"{KEY}={values}: allowed: [replicas, shards], two integers >= 1, by default "
                         "[trainer.num_nodes, trainer.devices] (one replica a node)")
    return values[0], values[1]


def check_mesh(mesh: Any, num_nodes: Any, devices: Any) -> None:
    """The mesh covers the world (``trainer.num_nodes`` x ``trainer.devices`` processes) exactly:
    its replica count divides the world and replicas x shards equals it."""
    from pelab.config import ConfigError

    if not (isinstance(devices, int) and devices >= 1):
        raise ConfigError(f"trainer.devices={devices!r}: trainer=hsdp needs the number of devices a node as an "
                          f"integer >= 1 (its device mesh is [trainer.num_nodes, trainer.devices]); allowed: e.g. "
                          "trainer.devices=8")
    try:
        replicas, shards = mesh_shape(mesh)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    world = num_nodes * devices
    if world % replicas or replicas * shards != world:
        divisors = [r for r in range(1, world + 1) if world % r == 0]
        raise ConfigError(
            f"{KEY}=[{replicas}, {shards}]: {replicas} replicas x {shards} shards is not the world of {world} "
            f"processes (trainer.num_nodes={num_nodes} x trainer.devices={devices})"
            + (f", and {replicas} does not divide it" if world % replicas else "")
            + f"; allowed: [R, {world}/R] with R one of {', '.join(map(str, divisors))}, by default "
              f"[{num_nodes}, {devices}] (one replica a node)")


def build_mesh(shape: tuple[int, int], device_type: str, world: int):
    """The 2-D mesh FSDP's ``HYBRID_SHARD`` takes: replicas outer, shards inner."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas, shards = shape
    if replicas * shards != world:
        raise ValueError(f"{KEY}=[{replicas}, {shards}]: {replicas} x {shards} is not the world of {world} "
                         f"processes this job started; allowed: [R, {world}/R] with R dividing {world}")
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
