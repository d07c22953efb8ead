"""Private names of torch, megatron-core, Lightning and Accelerate, each in one place with the
versions it was checked on: ``torch_internals`` (c10d's registry of groups, a default group built
outside ``init_process_group``, ``FakeProcessGroup``, the autograd engine, ``ShardedTensor``, DCP's
stager), ``megatron_internals`` (``parallel_state``'s globals, the distributed optimizer's shard
ranges and its loading of optimizer states), ``lightning_internals`` (process-group set-up, the
launcher, the Trainer's connectors, a strategy's and a logger's private attributes, the CLI's),
``accelerate_internals`` (the mark ``prepare`` leaves alone). Public API that differs between the
supported megatron-core releases: ``megatron_versions``. The rest of the package calls these, never
the private name (``tests/test_private_names.py``); ``tests/test_compat.py`` reads every private name
here from this folder's source and checks it is still where it is read. The CPU adapter
``devices/host/megatron_patches/`` patches megatron's private functions by design.

A private name looked up with a default (``getattr(x, "_name", None)``) either raises
``InternalsChangedError`` when it is missing or says on its line why skipping it is safe.
"""

from __future__ import annotations

import importlib.metadata


class InternalsChangedError(RuntimeError):
    """A private name of torch, megatron-core, Lightning or Accelerate that this package reads is not
    in the installed version; ``hint`` says what to change."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}. HINT: {hint}" if hint else message)

    @classmethod
    def missing(cls, package: str, name: str, *, checked_on: str) -> InternalsChangedError:
        """The error for ``name`` of ``package`` (its distribution name), read by this package and
        checked on ``checked_on``, missing from the installed version."""
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed = "(version unknown)"
        return cls(f"{package} {installed} has no {name}, which lightning-dynatrain reads (checked on {checked_on})",
                   hint=f"install a version it was checked on, or adapt lightning_dynatrain/compat/ to {package} "
                   f"{installed}")


__all__ = ["InternalsChangedError"]
