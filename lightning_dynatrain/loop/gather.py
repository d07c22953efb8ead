"""What every rank holds of one small picklable value: the loop engine's agreement checks (the same
batch, the same checkpoint folder) decide on it, every rank the same way."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def every_rank(mine: Any) -> list[Any]:
    """``mine`` as every rank of the default group passed it, by rank (collective: one all-gather)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


__all__ = ["every_rank"]
