"""``ElasticOptions``: how an elastic run changes its world, read once, for every front end.

``OnNodeChange(...)`` (the Trainer's callback) and ``DynaTrainFabricStrategy(elastic=...)`` (the
loop engine under Fabric) take the same options; each is checked here at construction, and
``driver`` makes the run's ``ElasticDriver`` from them. What each option does: ``OnNodeChange``'s
docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dynatrain.elastic.driver.layout_policy import Policy, StepModel, parse_policy

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.driver import ElasticDriver
    from lightning_dynatrain.elastic.driver.front import TrainingFront
    from lightning_dynatrain.runtime.training_run import TrainingRun


@dataclass(frozen=True)
class ElasticOptions:
    """The options of an elastic run (see ``OnNodeChange`` for each).

    Raises:
        LayoutError: the policy cannot be read.
        ValueError: ``snapshot_every``, ``snapshot_buffers`` or ``keep_worlds`` out of range.
    """

    policy: Policy = "auto"
    memory_per_rank: int | None = None
    step_model: StepModel = StepModel()
    heartbeat: float = 1.0
    exit_after: float = 30.0
    ahead: bool = True
    keep_worlds: int = 2
    recover: bool = True
    snapshot_every: int | None = None
    snapshot_buffers: int = 1

    def __post_init__(self) -> None:
        parse_policy(self.policy)  # fail at construction, not at the first change
        every, buffers, keep = self.snapshot_every, self.snapshot_buffers, self.keep_worlds
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"snapshot_every={every!r}: give a number of steps, 1 or more (None: no snapshots)")
        if buffers not in (1, 2) or isinstance(buffers, bool):
            raise ValueError(f"snapshot_buffers={buffers!r}: 1 (each snapshot overwrites the last) or 2 (the "
                             "previous snapshot stays whole while the next is taken)")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep_worlds={keep!r}: give a count of worlds, 0 or more (0: every world left is "
                             "destroyed)")
        if isinstance(self.policy, (str, Path)) and str(self.policy).lower() != "auto":
            object.__setattr__(self, "policy", Path(self.policy))  # a YAML file of the map

    def driver(self, run: "TrainingRun", front: "TrainingFront") -> "ElasticDriver":
        """The elastic driver of ``run``, reaching its loop through ``front``."""
        from lightning_dynatrain.elastic.driver.driver import ElasticDriver

        return ElasticDriver(run, front, policy=self.policy, memory_per_rank=self.memory_per_rank,
                             step_model=self.step_model, heartbeat=self.heartbeat, exit_after=self.exit_after,
                             ahead=self.ahead, keep_worlds=self.keep_worlds, recover=self.recover,
                             snapshot_every=self.snapshot_every, snapshot_buffers=self.snapshot_buffers)


__all__ = ["ElasticOptions"]
