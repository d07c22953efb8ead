"""The loop engine's side of an elastic run: ``LoopFront``, what the elastic driver needs of a ``DynaTrainEngine``.

The driver (``elastic.driver.ElasticDriver``) reaches the loop only through the small protocol
``elastic.driver.front.TrainingFront``, which the Lightning strategy implements too
(``strategy/elastic_front.py``). Here the step count is the engine's ``step``; stopping sets its
``should_stop`` (the user's loop ends there); a joiner receives the engine's progress
(``state_dict``: step, schedule, switch history) as a resume would load it; the launcher and the
world the library reports are the library's (``ElasticLoopLibrary.launch``, ``.follow``).
The engine keeps no loggers: a loop logs where it likes (log from ``engine.rank == 0``, which may
be another process after a change); the job's rank 0 prints the messages (the library's ``print``
is once per node of a launch, and the job's rank 0 may be any process of its launch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dynatrain.loop.library import ElasticLoopLibrary

if TYPE_CHECKING:
    from lightning_dynatrain.elastic.driver.front import Launch
    from lightning_dynatrain.elastic.session import ElasticSession
    from lightning_dynatrain.loop.engine import DynaTrainEngine


class LoopFront:
    """``TrainingFront`` for ``DynaTrainEngine`` (see the module docstring)."""

    def __init__(self, engine: "DynaTrainEngine") -> None:
        self._engine = engine
        self._session: ElasticSession | None = None

    @property
    def global_step(self) -> int:
        return self._engine.step

    def stop(self) -> None:
        self._engine.should_stop = True

    def loop_state(self) -> dict[str, Any]:
        """The engine's progress (no tensors: the state comes through the transition engine)."""
        return self._engine.state_dict()

    def restore_loop_state(self, state: dict[str, Any]) -> None:
        self._engine.load_state_dict(state)

    def launch(self) -> "Launch":
        """This process as the library's launcher started it (what the engine enters the job with)."""
        return self._library().launch()

    def joined(self, session: "ElasticSession") -> None:
        self._session = session
        self._library().follow(session)

    def rank_changed(self) -> None:
        assert self._session is not None, "joined() first"
        self._library().follow(self._session)

    def _library(self) -> "ElasticLoopLibrary":
        library = self._engine.library
        assert isinstance(library, ElasticLoopLibrary), "an elastic engine's library carries elastic runs"
        return library

    def log_versions(self) -> list[Any]:
        return []  # no loggers of its own

    def pin_log_versions(self, versions: list[Any]) -> None:
        pass

    def hand_off_logs(self) -> None:
        pass

    def continue_logs(self) -> None:
        pass

    def latest_checkpoint(self) -> str | None:
        return self._engine.last_checkpoint

    def job_description(self) -> tuple[Any, ...]:
        """The recipe, the optimizer's settings and the library (a joiner must train alike)."""
        engine = self._engine
        return ("DynaTrainEngine", engine.recipe, engine.optimizer_settings, engine.library.name,
                str(engine.library.params_dtype))

    def info(self, message: str) -> None:
        if self._engine.rank == 0:  # once per job: the job's rank 0, whatever its place in its launch
            print(message, flush=True)

    def warn(self, message: str) -> None:
        self.info(message)


__all__ = ["LoopFront"]
