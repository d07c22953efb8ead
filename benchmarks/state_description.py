"""Megatron-core's own description of a rank's training state, written for a test to compare
(``tests/megatron_description.py``): after a chosen step, or the state a recovery made.

``elastic_fit.py`` (the Trainer) and ``elastic_loop.py`` (the Fabric loop engine) write them; the
elastic tests assemble every survivor's file into the whole state and compare it bit for bit.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_description(out: Path, state: Any, name: str) -> None:
    """Megatron's description of this rank's ``state`` in ``OUT/<pid>.<name>.pkl`` (collective: every
    rank of the world)."""
    from tests.megatron_description import describe

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{os.getpid()}.{name}.pkl").write_bytes(pickle.dumps(describe(state)))


def describe_recovered(run: Any, out: Path, training: Callable[[], bool], *, once: bool = False) -> None:
    """A state ``run`` installs once ``training()`` holds (a recovery's, in the tests that ask) is
    described (``recovered``) right before the run trains on it again: a step redone, the steps
    since a snapshot computed again, or the next step. Each later install's state replaces the
    description (a second recovery's), unless ``once``: the first only (a job whose world changes
    after its recovery)."""
    install, train_step = run.install, run.train_step
    armed, written = [False], [False]

    def installed(state: Any) -> None:
        install(state)
        armed[0] = armed[0] or (training() and not (once and written[0]))

    def stepped(batch: Any, **kwargs: Any) -> Any:
        if armed[0]:
            armed[0], written[0] = False, True
            write_description(out, run.state, "recovered")
        return train_step(batch, **kwargs)

    run.install, run.train_step = installed, stepped


__all__ = ["describe_recovered", "write_description"]
