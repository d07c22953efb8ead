"""``ScheduledReconfig``: switch the parallel layout at given optimizer steps.

A schedule maps optimizer-step numbers to layouts. Entry ``S: L`` means: once ``S`` optimizer steps
are done (``trainer.global_step == S``, at ``on_train_batch_end``, after the optimizer step), switch
to ``L``; step ``S + 1`` runs at ``L``. An entry at step 0 (or at or before the step a run resumes
from, if it has not run yet) is applied at ``on_train_start``.

Three ways to write it::

    ScheduledReconfig({200: "dp1-tp2-pp2", 400: "dp4-tp1-pp1"})
    ScheduledReconfig("200:dp1-tp2-pp2,400:dp4-tp1-pp1")
    ScheduledReconfig("schedule.yaml")      # schedule: {200: dp1-tp2-pp2, 400: dp4-tp1-pp1}

The whole schedule is checked at ``setup`` against the model (``GPTShape`` rules), the batch sizes
and the world size, so a bad layout at step 5000 fails before step 1, naming step 5000 and the rule.
Reading, checking and running the entries is ``runtime.switch_schedule.SwitchSchedule``'s (the loop
engine drives the same one); this callback hands it Lightning's step boundaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dynatrain.compat.lightning_internals import callback_state_key, log_this_step
from lightning_dynatrain.runtime.switch_schedule import ScheduleError, ScheduleLike, SwitchSchedule
from lightning_dynatrain.vps.layout import ParallelConfig

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy


class ScheduledReconfig(Callback):
    """Switch ``DynaTrainStrategy``'s layout at the optimizer steps of a schedule.

    Args:
        schedule: ``{step: layout}``, ``"STEP:LAYOUT,STEP:LAYOUT"``, or a YAML file path with a
            ``schedule:`` mapping (see module docstring). Empty/``None``: never switch.
        on_refused: what a switch refused before anything moved does (memory, staging budget, a
            target that does not fit the current world; ``transition.errors.was_refused``):
            ``"continue"`` (default) warns with the reason, records it (``refusals``) and training
            goes on at the old layout; ``"raise"`` ends ``fit`` with the error. A switch that fails
            once bytes moved raises, unless ``switch_safety="keep_old"`` rolled it back with the
            old state whole on every rank: that counts as refused.
        ahead: build each entry's switch ahead (``DynaTrainStrategy.prepare_reconfigure``): from
            the first step after the switch before it, its program and megatron objects are built
            in a background thread while training steps on, and the switch itself only binds their
            memory and moves the state. ``False``: every switch builds on demand, inside the pause.

    Raises:
        ScheduleError: at construction, when the schedule cannot be read; at ``setup``, when an entry
            does not fit the model, the batch or the world (the message names its step and the rule).
        TypeError: at ``setup``, when the Trainer's strategy is not a ``DynaTrainStrategy``.

    Example::

        trainer = Trainer(strategy=DynaTrainStrategy("dp2-tp2-pp1"), devices=4,
                          callbacks=[ScheduledReconfig({200: "dp1-tp2-pp2"})])

    State (``state_dict``): the steps whose switch already ran or was refused, so a resumed run does
    not repeat them, and the refusals (``(step, layout, error type, message)``).
    """

    def __init__(self, schedule: ScheduleLike, *, on_refused: Literal["continue", "raise"] = "continue",
                 ahead: bool = True) -> None:
        self.driver = SwitchSchedule(schedule, on_refused=on_refused, ahead=ahead)

    @property
    def schedule(self) -> dict[int, ParallelConfig]:
        """``{step: layout}``, sorted by step."""
        return self.driver.entries

    @property
    def done(self) -> set[int]:
        """The entries run or refused."""
        return self.driver.done

    @property
    def refusals(self) -> list[tuple[int, str, str, str]]:
        """The entries refused before anything moved: ``(step, layout, error type, message)``."""
        return self.driver.refusals

    @property
    @override
    def state_key(self) -> str:
        return callback_state_key(self, schedule=tuple((s, str(l)) for s, l in self.schedule.items()))

    @staticmethod
    def _strategy(trainer: "pl.Trainer") -> "DynaTrainStrategy":
        from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy

        if not isinstance(trainer.strategy, DynaTrainStrategy):
            raise TypeError(f"ScheduledReconfig needs DynaTrainStrategy, the Trainer runs "
                            f"{type(trainer.strategy).__name__}. HINT: Trainer(strategy=DynaTrainStrategy(...))")
        return trainer.strategy

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or not self.schedule:
            return
        strategy = self._strategy(trainer)
        recipe = getattr(pl_module, "recipe", None)  # the module's: callbacks' setup runs before configure_model
        self.driver.check(world_size=trainer.world_size, start=strategy.layout,
                          model=recipe.model if recipe is not None else None,
                          global_batch_size=recipe.global_batch_size if recipe is not None else None,
                          micro_batch_size=recipe.micro_batch_size if recipe is not None else None,
                          warn=rank_zero_warn)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._switch_due(trainer)  # step 0, or entries a resumed run has passed: the latest of them

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        """Build the next entry that changes the layout ahead, in the background (``ahead``), unless
        that build runs already (it is dropped by a switch elsewhere, e.g. ``reconfigure``): between
        two steps, before this one, so the build runs beside it."""
        strategy = self._strategy(trainer)
        if strategy.elastic is not None:  # an elastic run's worlds change under a build
            return
        self.driver.prepare_next(trainer.global_step, current=strategy.layout,
                                 prepared=strategy.switcher.prepared_pair, prepare=strategy.prepare_reconfigure,
                                 say=self._warn)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        try:
            self._switch_due(trainer)
        except BaseException:  # the loop logs this step's metrics after the callbacks: the fit ends first
            log_this_step(trainer)
            raise

    def _switch_due(self, trainer: "pl.Trainer") -> None:
        strategy = self._strategy(trainer)
        self.driver.run_due(trainer.global_step, switch=strategy.reconfigure, current=lambda: strategy.layout,
                            say=self._warn)

    @staticmethod
    def _warn(message: str) -> None:
        rank_zero_warn(f"ScheduledReconfig: {message}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.driver.load_state_dict(state_dict)

__all__ = ["ScheduleError", "ScheduledReconfig"]
