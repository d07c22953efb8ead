"""A byte-level language-modelling dataset over a corpus every machine has: the Python stdlib's ``.py`` files.

The corpus is the concatenation of the standard library's own source files, found from
``sysconfig.get_paths()["stdlib"]``, sorted by relative path (``site-packages`` and
``dist-packages`` excluded, they are not the stdlib and differ between machines). Tokens are the
bytes themselves (vocabulary 256). Sample ``i`` is the window ``[i*S, i*S + S + 1)`` of the byte
stream, split into ``tokens = window[:-1]`` and ``labels = window[1:]`` (next-byte prediction), so
samples do not overlap and every one has exactly ``S`` targets.

Example::

    ds = StdlibBytes(seq_length=128)
    ds[0]["tokens"].shape, ds[0]["labels"].shape   # (torch.Size([128]), torch.Size([128]))
    len(ds)                                          # about 31.5 MB / 128 on Python 3.11
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import torch
from torch.utils.data import Dataset

#: Byte-level tokens: one per byte value.
VOCAB_SIZE = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The stdlib's ``.py`` files under ``root`` (default: this interpreter's stdlib), sorted by relative path."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [p for p in base.rglob("*.py") if not _EXCLUDED_DIRS.intersection(p.relative_to(base).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


@lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int | None = None, root: str | None = None) -> torch.Tensor:
    """The corpus as a flat ``uint8`` tensor (files concatenated in sorted order), cut to ``max_bytes``.

    Cached per process: several datasets over the same corpus share one tensor.
    """
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_sources(root):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    blob = b"".join(chunks)
    if max_bytes is not None:
        blob = blob[:max_bytes]
    if not blob:
        raise FileNotFoundError(f"no .py files found under {root or sysconfig.get_paths()['stdlib']}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class StdlibBytes(Dataset):
    """Fixed-length next-byte samples over the stdlib corpus (see module docstring).

    Args:
        seq_length: tokens per sample (the model's sequence length).
        max_bytes: use only the first ``max_bytes`` of the corpus (``None``: all of it, ~31 MB).
        root: read ``.py`` files from this directory instead of the stdlib (tests).

    Each item is ``{"tokens": int64[S], "labels": int64[S]}``.
    """

    def __init__(self, seq_length: int, *, max_bytes: int | None = None, root: str | Path | None = None) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be positive")
        self.seq_length = seq_length
        self.data = stdlib_corpus(max_bytes, None if root is None else str(root))
        self._len = (self.data.numel() - 1) // seq_length
        if self._len < 1:
            raise ValueError(f"corpus of {self.data.numel()} bytes is shorter than one sample of {seq_length + 1}")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} outside [0, {self._len})")
        start = index * self.seq_length
        window = self.data[start : start + self.seq_length + 1].long()
        return {"tokens": window[:-1], "labels": window[1:]}


__all__ = ["StdlibBytes", "VOCAB_SIZE", "stdlib_corpus", "stdlib_sources"]
