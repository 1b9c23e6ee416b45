"""Moving tensors between logical devices: the collectives of a tensor-parallel program.

Built on iree-turbine's `transfer_to_logical_device` (a `flow.tensor.transfer` to
`#hal.device.promise<@__device_{r}>`) and `barrier_on_logical_device` (pins a value to a device
without moving it). Eagerly, a transfer is a copy and a barrier is the identity, so the same code
runs as a PyTorch model and traces into a multi-device IREE program. Device r is the logical
device `__device_{r}`, which `--iree-hal-target-device=local[r]` (or `hip[r]`, ...) defines.

Each value is explicitly placed on the device that uses it: a value used on several devices is
transferred to each, never shared, so the compiler cannot merge the copies and leave one device
reading another's memory.
"""

from __future__ import annotations

import torch
from iree.turbine.ops.iree import barrier_on_logical_device, transfer_to_logical_device


def to_device(t: torch.Tensor, rank: int, source: int | None = None) -> torch.Tensor:
    """t on device `rank`: a barrier when it is already there (`source == rank`), else a transfer."""
    if source == rank:
        return barrier_on_logical_device(str(rank), t)
    return transfer_to_logical_device(str(rank), t)


def replicate(t: torch.Tensor, n: int, source: int = 0) -> list[torch.Tensor]:
    """A tensor on device `source` → one copy on each of devices 0..n-1."""
    return [to_device(t, r, source) for r in range(n)]


def all_reduce(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """parts[r] on device r → their sum on every device: summed on device 0 (in rank order, so
    the result does not depend on timing), then sent back out."""
    total = to_device(parts[0], 0, source=0)
    for r in range(1, len(parts)):
        total = total + to_device(parts[r], 0, source=r)
    return replicate(total, len(parts))


def gather(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """parts[r] on device r → their concatenation along `dim` on device 0."""
    return torch.cat([to_device(p, 0, source=r) for r, p in enumerate(parts)], dim=dim)
