"""A joiner's side of a grow: the collectives a process started later takes part in, in this order,
which the old members run at the change's boundary (``world_change.change_world``; built ahead, the
default, (1) and (2) run at the boundary before, see ``strategy/elastic_ahead.py``, and the Adam
step comes at the swap):

1. the *header* broadcast from the new world's rank 0, an old member: the target layout, the source
   layout, the global and Adam step (``join_header`` makes it, ``ElasticDriver.enter`` receives it);
2. megatron's groups for the target and the new world's topology (one all-gather) (``enter``);
3. the state: the planner and engine move every tensor from the old members to their new places
   (``receive_state``, in ``strategy.setup``, after the joiner's model and optimizer are built);
4. Lightning's own state (loops, callbacks, data module; no tensors) from rank 0, restored as a
   resumed fit restores it (``receive_trainer_state``);
5. the report of this change (``ChangeReport``, rank 0's), once the members have it: the joiner's
   ``OnNodeChange.changes`` holds the grow that admitted it, as every member's does, so the job's
   history survives the first members leaving.

Between those steps the joiner's Lightning runs collectives of its own set-up (barriers, the log
dir broadcast, the dataloader length check) that the old members passed long ago: while
``ElasticDriver.catching_up`` they are local, until ``on_train_start``.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_dynatrain.compat.lightning_internals import restore_as_loaded
from lightning_dynatrain.elastic.session import JOIN_FAULT_ENV
from lightning_dynatrain.strategy.change_report import ChangeReport
from lightning_dynatrain.strategy.loggers import logger_versions
from lightning_dynatrain.strategy.world_change import broadcast_object
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl

    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.strategy.elastic import ElasticDriver


def join_header(driver: "ElasticDriver", trainer: "pl.Trainer", target: ParallelConfig) -> dict[str, Any]:
    """(1) what a joiner learns first: the layouts, the step, the loggers' versions, whether the
    target is built ahead (its Adam step then comes in a broadcast of its own at the swap)."""
    from lightning_dynatrain.megatron.state_bridge import adam_step

    strategy = driver.strategy
    return {"layout": str(target), "src": str(strategy.layout), "step": trainer.global_step,
            "adam_step": None if driver.ahead else adam_step(strategy.megatron.optimizer) or 0,
            "ahead": driver.ahead, "loggers": logger_versions(trainer.loggers)}


def receive_state(driver: "ElasticDriver", build: "Callable[[], MegatronState]") -> "MegatronState":
    """(3) A joiner's state from the old members: ``build()`` makes its DDP and optimizer at the
    target (after the memory check, in the old members' order; or first, where they built theirs
    ahead), the engine fills them."""
    from lightning_dynatrain.megatron.build_collectives import build_collectives
    from lightning_dynatrain.megatron.hot_switch import receive_state as receive

    session, header, strategy = driver.session, driver.header, driver.strategy
    assert session is not None and session.joined_change is not None and header is not None
    ahead = bool(header["ahead"])
    setup = strategy.switcher.world_change_setup(strategy.recipe, strategy.optimizer_settings)

    def build_beside_theirs() -> "MegatronState":
        if os.environ.get(JOIN_FAULT_ENV) == "STOP_IN_BUILD":  # test hook (elastic.session)
            os.kill(os.getpid(), signal.SIGSTOP)
        with build_collectives(dist.GroupMember.WORLD):  # a peer whose build failed is named, not a TypeError
            return build()

    def step_at_the_swap() -> int:  # the others swapped: the switch has begun
        step = int(broadcast_object(None)["adam_step"])
        if os.environ.get(JOIN_FAULT_ENV) == "STOP_IN_SWITCH":  # test hook (elastic.session)
            os.kill(os.getpid(), signal.SIGSTOP)
        return step

    result = receive(build_beside_theirs if ahead else build, strategy.model_shard,
                     ParallelConfig.parse(header["src"]), strategy.layout, setup,
                     step=step_at_the_swap if ahead else int(header["adam_step"]),
                     members=session.joined_change.members, ahead=ahead,
                     watch=strategy.switcher.world_watch)  # where the others make theirs
    return result.state


def receive_trainer_state(driver: "ElasticDriver", trainer: "pl.Trainer") -> None:
    """(4) Lightning's state from rank 0, restored as a resumed fit restores it (no tensors), and
    the rate the schedulers set last (the optimizer's: its tensors came through the engine); (5) the
    report of the grow that admitted this process (rank 0's, once its figures are known)."""
    checkpoint = broadcast_object(None)
    restore_as_loaded(trainer, checkpoint)
    scalars = (checkpoint.get("optimizer_states") or [{}])[0]
    if "schedule" in scalars:
        driver.strategy.optimizer_handle.load_schedule(scalars["schedule"])
    driver.admitted_by = ChangeReport(**broadcast_object(None))
    driver.history.append(driver.admitted_by)
