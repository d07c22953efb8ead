"""Accelerate's private names this package uses, each behind a name here, checked on accelerate 1.15.0.

The mark ``Accelerator.prepare`` reads to leave an object as it is (``_is_accelerate_prepared``,
which Accelerate sets on what it prepared, so that it never wraps an object twice): the loop's
model, optimizer and global-batch loader carry it, so that ``prepare`` records them and returns
them unwrapped and unsharded (``loop/prepared.py``, ``loop/data.py``).
``tests/test_private_names.py`` fails on a private name used elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what reads the mark: Accelerator.prepare_model, prepare_optimizer, prepare_data_loader
    from accelerate import Accelerator  # noqa: F401


def mark_prepared(obj: Any) -> None:
    """``accelerator.prepare(obj)`` returns ``obj`` as it is (a model: no DDP, no device move, no
    autocast; a loader: no sharding), recording a model or an optimizer for ``save_state``."""
    obj._is_accelerate_prepared = True


__all__ = ["mark_prepared"]
