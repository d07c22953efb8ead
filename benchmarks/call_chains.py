"""The package files on the call chains that reach chosen calls: how far a reader follows one path.

``switch_path.py`` measures two paths with it: a layout switch (from ``reconfigure`` to its first
``batch_isend_irecv``) and an unannounced death (on a survivor, from the failed collective to training
resumed, traced inside an elastic fit by ``elastic_fit.py --trace-death``). A *chain* is the list of
``lightning_dynatrain`` files on the Python stack at one moment, outermost first, each once; a path's
files are the union of its chains in order of first appearance. Only calls count, not imports.

``DeathTrace`` needs nothing of the package but the name of its recovery guard (``GUARDS``: where each
version of the package hands a failed collective to the recovery), so the same measure runs on an
older tree.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dynatrain"
TORCH_DISTRIBUTED = "torch/distributed/"

#: where each version of the package hands a member's death to the recovery: (file, function)
GUARDS = (("lightning_dynatrain/elastic/driver/recovery.py", "recover_or_raise"),
          ("lightning_dynatrain/strategy/elastic.py", "recover"))
#: the ``torch.distributed`` calls that talk to other processes or make their groups
COMMUNICATION = frozenset({
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "new_group", "new_subgroups", "init_process_group", "destroy_process_group",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list"})
#: the store's calls (``torch.distributed.Store`` methods, C functions)
STORE_CALLS = frozenset({"get", "set", "wait", "check", "add", "compare_set", "multi_get", "multi_set",
                         "delete_key", "num_keys", "append"})


def _callee(frame: FrameType) -> str:
    """The name of the function ``frame`` runs, seen through c10d's decorators (their ``wrapper``)."""
    func = frame.f_locals.get("func") if frame.f_code.co_name == "wrapper" else None
    return getattr(func, "__name__", frame.f_code.co_name)


def package_file(frame: FrameType) -> str | None:
    """``frame``'s file relative to the repository when it is the package's, else ``None``."""
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(ROOT)) if path.is_relative_to(PACKAGE) else None


def chain_of(frame: FrameType | None, *, start: FrameType | None = None) -> list[str]:
    """The package files on the stack ending at ``frame``, outermost first, each once; from the frame
    ``start`` inward when it is on that stack (the frames that called it are left out)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        if frame is start:
            break
        frame = frame.f_back
    return list(dict.fromkeys(f for f in map(package_file, reversed(frames)) if f is not None))


def union(chains: list[list[str]]) -> list[str]:
    """The files of ``chains``, in order of first appearance."""
    return list(dict.fromkeys(f for chain in chains for f in chain))


def folder_changes(files: list[str]) -> int:
    """How many times a reader following ``files`` in order changes folder."""
    folders = [str(Path(f).parent) for f in files]
    return sum(a != b for a, b in zip(folders, folders[1:]))


class DeathTrace:
    """On a survivor: the chains of a recovery, from the guard's call until ``stop`` (the next step that
    completed). Recorded:

    - ``failed``: the files the failed collective's traceback passes, from the frame that caught it;
    - ``guard``: the chain from that frame to the guard;
    - ``events``: the chain (from the catching frame) to every call into ``torch.distributed`` or the
      store until ``stop``, with what was called;
    - ``first_transfer``: the chain to the recovery switch's first ``batch_isend_irecv``.
    """

    def __init__(self) -> None:
        self.catch: FrameType | None = None
        self.failed: list[str] = []
        self.guard: list[str] = []
        self.events: list[tuple[str, list[str]]] = []
        self.first_transfer: list[str] | None = None
        self._armed = True

    def start(self) -> None:
        """Watch every call of this (the training) thread from now on (until the guard is reached, only
        each call's name is read)."""
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        self._armed = False

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if not self._armed:
            return
        if self.catch is None:
            if event == "call" and (package_file(frame), frame.f_code.co_name) in GUARDS:
                self._enter_guard(frame)
            return
        if event == "call" and TORCH_DISTRIBUTED in frame.f_code.co_filename.replace("\\", "/") \
                and frame.f_back is not None and TORCH_DISTRIBUTED not in frame.f_back.f_code.co_filename:
            name = _callee(frame)
            if name in COMMUNICATION:
                self._event(name, frame)
        elif event == "c_call" and getattr(arg, "__name__", None) in STORE_CALLS \
                and type(getattr(arg, "__self__", None)).__name__.endswith("Store"):
            self._event(f"store.{arg.__name__}", frame)

    def _enter_guard(self, frame: FrameType) -> None:
        err = frame.f_locals.get("err") or frame.f_locals.get("error")
        tb = getattr(err, "__traceback__", None)
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        self.catch = frames[0] if frames else frame.f_back
        self.failed = list(dict.fromkeys(f for f in map(package_file, frames) if f is not None))
        self.guard = chain_of(frame, start=self.catch)

    def _event(self, name: str, frame: FrameType) -> None:
        chain = chain_of(frame, start=self.catch)
        self.events.append((name, chain))
        if name == "batch_isend_irecv" and self.first_transfer is None:
            self.first_transfer = chain

    def result(self) -> dict:
        """The measures (see the module docstring), as plain data."""
        resumed = [chain for name, chain in self.events if chain and chain[-1].endswith("megatron/train_step.py")]
        stack = union([self.failed, self.guard, self.first_transfer or [], *resumed])
        every = union([self.failed, self.guard, *(chain for _, chain in self.events)])
        chains: dict[tuple[str, ...], str] = {}
        for name, chain in self.events:
            chains.setdefault(tuple(chain), name)
        return {"stack": stack, "collective": every, "events": len(self.events),
                "chains": [[name, list(chain)] for chain, name in chains.items()],
                "stack_folder_changes": folder_changes(stack), "collective_folder_changes": folder_changes(every),
                "reached_guard": self.catch is not None}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.result(), indent=1))


def stack_files(skip: int = 1) -> list[str]:
    """The package files on the caller's stack, outermost first (``switch_path``'s switch job)."""
    return chain_of(inspect.stack()[skip].frame)


__all__ = ["DeathTrace", "GUARDS", "chain_of", "folder_changes", "package_file", "stack_files", "union"]
