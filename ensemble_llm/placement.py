"""Where the members run, checked before anything loads: `placement="local"` (in this process,
one device and dtype per member) or `placement="ray"` (each member in a Ray actor, with its
`member_resources`; the actors resolve "auto" devices and dtypes where they run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import ConfigError
from .members.loader import resolve_device, resolve_dtype


@dataclass(frozen=True)
class Placement:
    kind: str  # "local" or "ray"
    devices: list  # torch.device per member (ray: the caller's side, CPU)
    dtypes: list  # torch.dtype per member (ray: the dtype name each actor resolves)
    ray_address: str | None = None
    member_resources: list[dict] | None = None


def plan_placement(
    placement: Any, ray_address: Any, member_resources: Any, device: Any, dtype: Any, n: int
) -> Placement:
    """The checked placement of `n` members; a bad combination raises ConfigError with the fix."""
    if placement not in ("local", "ray"):
        raise ConfigError(
            f"placement must be 'local' (members in this process) or 'ray' (each member in a "
            f"Ray actor), got {placement!r}"
        )
    if ray_address is not None and (placement != "ray" or not isinstance(ray_address, str)):
        raise ConfigError(
            f"ray_address={ray_address!r} needs placement='ray' and a string address "
            "('auto', 'ray://HEAD:10001' or 'HOST:6379')"
        )
    if member_resources is not None and placement != "ray":
        raise ConfigError("member_resources applies to placement='ray' only (Ray resources per member actor)")
    devices = list(device) if isinstance(device, (list, tuple)) else [device] * n
    if len(devices) != n:
        raise ConfigError(f"device lists {len(devices)} entries for {n} members; give one per member.")
    if placement == "local":
        resolved = [resolve_device(d) for d in devices]
        return Placement("local", resolved, [resolve_dtype(dtype, d) for d in resolved])
    from .ray import check_member_resources

    if any(d not in ("auto", None) for d in devices):
        raise ConfigError(
            "with placement='ray' each member's device is its actor's: a GPU where "
            "member_resources gives it one (the default on a cluster with GPUs), else the "
            "CPU; leave device='auto' and set member_resources=[{'num_gpus': 1}, ...]."
        )
    resources = check_member_resources(member_resources, n)
    resolve_dtype(dtype, torch.device("cpu"))  # a bad name fails here; "auto" is resolved by each actor
    name = "auto" if dtype is None else dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    return Placement("ray", [torch.device("cpu")] * n, [name] * n, ray_address, resources)


MAX_BATCH = {"cpu": 8, "cuda": 32}  # "auto": requests run at once per device kind (members/scheduler.py)


def resolve_max_batch(value: Any, placement: str, devices: Sequence[Any]) -> int:
    """How many requests run at once: an int >= 1, or "auto" (8 on CPU, 32 when every member is on
    CUDA; 8 with Ray placement, whose actors' devices are not known before they start)."""
    if value == "auto":
        if placement == "ray":
            return MAX_BATCH["cpu"]
        kinds = {torch.device(d).type for d in devices}
        return MAX_BATCH["cuda"] if kinds == {"cuda"} else MAX_BATCH["cpu"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f'max_batch must be an int >= 1 or "auto", got {value!r}')
    return value
