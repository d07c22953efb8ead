"""A joiner's side of a grow: the collectives a process started later takes part in, in this order,
which the old members run at the change's boundary (``world_change.change_world``; built ahead, the
default, (1) and (2) run at the boundary before, see ``elastic/driver/ahead_change.py``, and the Adam
step comes at the swap):

1. the *header* broadcast from the new world's rank 0, an old member: the target layout, the source
   layout, the global and Adam step (``join_header`` makes it, ``ElasticDriver.enter`` receives it);
2. megatron's groups for the target and the new world's topology (one all-gather) (the front end's
   ``TrainingRun.start``);
3. the state: the planner and engine move every tensor from the old members to their new places
   (``receive_state``, in the front end's optimizer set-up, after the joiner's model and optimizer
   are built: ``ElasticDriver.join_state``);
4. the loop's own state (Lightning's loops, callbacks, data module; no tensors) from rank 0,
   restored as a resumed fit restores it (``receive_trainer_state``, ``TrainingFront.restore_loop_state``);
5. the report of this change (``ChangeReport``, rank 0's), once the members have it: the joiner's
   ``OnNodeChange.changes`` holds the grow that admitted it, as every member's does, so the job's
   history survives the first members leaving.

Between those steps the joiner's loop runs collectives of its own set-up (Lightning's barriers, the
log dir broadcast, the dataloader length check) that the old members passed long ago: while
``ElasticDriver.catching_up`` they are local, until training starts.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_dynatrain.elastic.driver.change_report import ChangeReport
from lightning_dynatrain.elastic.session import JOIN_FAULT_ENV
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.megatron.state import MegatronState


def join_header(driver: "ElasticDriver", target: ParallelConfig) -> dict[str, Any]:
    """(1) what a joiner learns first: the layouts, the step, the loggers' versions, whether the
    target is built ahead (its Adam step then comes in a broadcast of its own at the swap)."""
    from lightning_dynatrain.megatron.state_bridge import adam_step

    run, front = driver.run, driver.front
    return {"layout": str(target), "src": str(run.layout), "step": front.global_step,
            "adam_step": None if driver.ahead else adam_step(run.state.optimizer) or 0,
            "ahead": driver.ahead, "loggers": front.log_versions()}


def receive_state(driver: "ElasticDriver", build: "Callable[[], MegatronState]") -> "MegatronState":
    """(3) A joiner's state from the old members: ``build()`` makes its DDP and optimizer at the
    target (after the memory check, in the old members' order; or first, where they built theirs
    ahead), the engine fills them."""
    from lightning_dynatrain.megatron.build_collectives import build_collectives
    from lightning_dynatrain.megatron.hot_switch import receive_state as receive

    session, header, run = driver.session, driver.header, driver.run
    assert session is not None and session.joined_change is not None and header is not None
    ahead = bool(header["ahead"])
    setup = run.switcher.world_change_setup(run.recipe, run.optimizer_settings)

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

    result = receive(build_beside_theirs if ahead else build, run.model_shard,
                     ParallelConfig.parse(header["src"]), run.layout, setup,
                     step=step_at_the_swap if ahead else int(header["adam_step"]),
                     members=session.joined_change.members, ahead=ahead,
                     watch=run.switcher.world_watch)  # where the others make theirs
    return result.state


def receive_trainer_state(driver: "ElasticDriver") -> None:
    """(4) The loop's state from rank 0, restored as a resumed fit restores it (no tensors; the
    front end restores the rate its schedulers set last too); (5) the report of the grow that
    admitted this process (rank 0's, once its figures are known)."""
    driver.front.restore_loop_state(broadcast_object(None))
    driver.admitted_by = ChangeReport(**broadcast_object(None))
    driver.history.append(driver.admitted_by)


def broadcast_object(obj: Any) -> Any:
    """One object from rank 0 of the world to every rank (a real collective, whatever the front
    end's collectives do while catching up)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = ["broadcast_object", "join_header", "receive_state", "receive_trainer_state"]
