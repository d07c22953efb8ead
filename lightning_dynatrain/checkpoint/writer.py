"""Writing a layout-free checkpoint directory with DCP, synchronously or in the background.

A save writes into a staging directory beside the target (``.<name>.saving``) and rank 0 renames
it onto the target once every rank's files and DCP's ``.metadata`` are on disk: a checkpoint path
holds either the previous complete checkpoint or the new one, never a half-written directory
(``ModelCheckpoint(save_last=True)`` rewrites ``last.ckpt`` at every save).

``async_save=True`` (``dcp.async_save``): the step only waits for a copy of this rank's primary
pieces to CPU memory (made by ``logical_state_dict(copy_to_cpu=True)``: live views cannot be
written later, training changes them), then DCP writes from a background thread. That thread's
collectives run on a gloo group of their own (made at the first background save; the training
thread keeps the default group), so the two never interleave on one group. A save waits for
the previous one (``wait``) before it starts, removing or overwriting a checkpoint being written
waits for it (``wait_for``), and ``close`` (the strategy's teardown) waits for the last one. A
background save that failed raises its error at the next of these.

Example (every rank)::

    writer = CheckpointWriter(async_save=True)
    writer.save(state, "ckpt/step=3.ckpt", rank=rank)    # returns once the copy is made
    ...training...
    writer.close()                                          # the files are complete
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_dynatrain.compat.torch_internals import already_staged_stager


def staging_dir(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.saving")


def remove_path(path: str | Path) -> None:
    """Remove a checkpoint path: a link or file (``save_last="link"``, another strategy's file) or a directory."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def commit(staging: Path, path: Path) -> None:
    """Put the complete checkpoint in ``staging`` at ``path`` (rank 0 only)."""
    remove_path(path)
    staging.rename(path)


class _Pending:
    """One background save: its future, and rank 0's rename once it is complete."""

    def __init__(self, future: Future, staging: Path, path: Path, *, commits: bool) -> None:
        self.path, self._staging, self._commits = path, staging, commits
        self._error: BaseException | None = None
        self._done = threading.Event()
        future.add_done_callback(self._finish)
        self._future = future

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            if self._commits:
                commit(self._staging, self.path)
        except BaseException as err:  # raised to the training thread at the next wait
            self._error = err
        finally:
            self._done.set()

    def result(self) -> None:
        self._done.wait()
        dist.barrier()  # rank 0 has renamed the checkpoint into place before any rank goes on
        if self._error is not None:
            raise RuntimeError(f"the background save of checkpoint {self.path} failed: {self._error!r}. HINT: "
                               "the previous complete checkpoint at that path (if any) is untouched; check the "
                               "disk and the error, then save again") from self._error


class CheckpointWriter:
    """Writes DCP state dicts as checkpoint directories; one per strategy (see the module docstring).

    Args:
        async_save: write in a background thread (``dcp.async_save``); the state dict handed to
            ``save`` must then already be a private copy (``logical_state_dict(copy_to_cpu=True)``).
    """

    def __init__(self, *, async_save: bool = False) -> None:
        self.async_save = async_save
        self._pending: _Pending | None = None
        self._group: dist.ProcessGroup | None = None

    @property
    def pending_path(self) -> Path | None:
        """The checkpoint a background save is writing (not yet known complete), if any."""
        return None if self._pending is None else self._pending.path

    def storage_writer(self, directory: Path) -> dcp.StorageWriter:
        """DCP's writer of one checkpoint directory (files fsynced before the rename)."""
        return dcp.FileSystemWriter(directory, sync_files=True)

    def save(self, state: dict[str, Any], path: str | Path, *, rank: int) -> None:
        """Write ``state`` as checkpoint ``path`` (collective over the world)."""
        self.wait()
        path = Path(path)
        staging = staging_dir(path)
        if rank == 0:
            remove_path(staging)  # a save that died before its rename
            staging.mkdir(parents=True)
        dist.barrier()
        writer = self.storage_writer(staging)
        if not self.async_save:
            dcp.save(state, storage_writer=writer)  # returns on every rank once .metadata is written
            if rank == 0:
                commit(staging, path)
            dist.barrier()
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                async_stager=already_staged_stager())
        self._pending = _Pending(future, staging, path, commits=rank == 0)

    def wait(self) -> None:
        """Return once the background save (if any) is complete and in place; raise its error if it
        failed. Collective when a save is pending (every rank has one: saves are collective)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_for(self, path: str | Path) -> None:
        """``wait`` if the background save writes ``path``."""
        if self._pending is not None and Path(path).absolute() == self._pending.path.absolute():
            self.wait()

    def close(self) -> None:
        """Wait for the last save and release the background saves' group (collective when one was made)."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


__all__ = ["CheckpointWriter", "commit", "remove_path", "staging_dir"]
