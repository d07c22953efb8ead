"""The host's memory figures, read from Linux's ``/proc`` files: what the memory check compares a
switch's need with on CPU (``HostKind.free_bytes``), and what the benchmarks measure.

Example::

    free = host_available_bytes()  # None where the kernel does not say
"""

from __future__ import annotations


def proc_field_bytes(path: str, field: str) -> int | None:
    """Bytes of a ``Field:  N kB`` line of a ``/proc`` file, or ``None`` without that line (or file)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_available_bytes() -> int | None:
    """The host's ``MemAvailable`` (Linux), or ``None`` where the kernel does not say."""
    return proc_field_bytes("/proc/meminfo", "MemAvailable")


__all__ = ["host_available_bytes", "proc_field_bytes"]
