"""How long a switch may wait on its peers: ``SwitchDeadline``.

Every wait of a switch (its collectives, its point-to-point transfers, the creation of its groups)
is bounded by one deadline, given to the process groups as their own timeout (``switch_watch``).
By default it is derived from what the rank's program moves and the measured link speed, with a
wide margin and a floor (a rank's peers also rebuild their model while it waits on them):

    seconds = floor_s + margin * (point-to-point bytes / p2p speed + broadcast bytes / broadcast speed)

Without measured links the speed is taken as ``FALLBACK_BYTES_PER_S`` (50 MiB/s, slower than any
network a job trains over). ``DynaTrainStrategy(switch_timeout=...)`` replaces the derived value.

Example::

    deadline = SwitchDeadline.derive(program, link_costs)   # or SwitchDeadline.fixed(120)
    str(deadline)   # "64 s (60 s floor + 10 x 0.4 s to move 19.0 MiB at 48.0 MiB/s)"
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from lightning_dynatrain.transition.collectives import LinkCosts
from lightning_dynatrain.transition.program import Broadcast, Exchange, SwitchProgram
from lightning_dynatrain.transition.staging import format_bytes
from lightning_dynatrain.vps.errors import DynaTrainError

#: the speed assumed when the links were not measured
FALLBACK_BYTES_PER_S = 50 * 2**20
DEFAULT_FLOOR_S = 60.0
DEFAULT_MARGIN = 10.0


@dataclass(frozen=True, slots=True)
class SwitchDeadline:
    """The longest a rank's switch waits on any one of its collectives or transfers (seconds), and
    where that figure comes from (``why``, for messages)."""

    seconds: float
    why: str = "switch_timeout"

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise DynaTrainError(f"a switch deadline must be a positive number of seconds, got {self.seconds!r}",
                                 hint="pass switch_timeout=None (derived from the switch's bytes) or e.g. 120")

    @property
    def timedelta(self) -> timedelta:
        return timedelta(seconds=self.seconds)

    @classmethod
    def fixed(cls, seconds: float) -> "SwitchDeadline":
        return cls(float(seconds), "switch_timeout")

    @classmethod
    def derive(cls, program: SwitchProgram, costs: LinkCosts | None, *, margin: float = DEFAULT_MARGIN,
               floor_s: float = DEFAULT_FLOOR_S) -> "SwitchDeadline":
        """The deadline of ``program`` over links ``costs`` (see the module docstring)."""
        p2p, bcast = moved_bytes(program)
        p2p_speed = costs.p2p_bytes_per_s if costs is not None else FALLBACK_BYTES_PER_S
        bcast_speed = costs.broadcast_bytes_per_s if costs is not None else FALLBACK_BYTES_PER_S
        move_s = p2p / p2p_speed + bcast / bcast_speed
        speed = "measured" if costs is not None else "assumed"
        why = (f"{floor_s:.0f} s floor + {margin:g} x {move_s:.1f} s to move {format_bytes(p2p + bcast)} at "
               f"{speed} {p2p_speed / 2**20:.1f} MiB/s")
        return cls(floor_s + margin * move_s, why)

    def __str__(self) -> str:
        return f"{self.seconds:.0f} s ({self.why})"


def moved_bytes(program: SwitchProgram) -> tuple[int, int]:
    """Bytes ``program`` sends plus receives point to point, and bytes its broadcasts carry."""
    p2p = sum(m.nbytes for s in program.steps if isinstance(s, Exchange) for m in s.sends + s.recvs)
    bcast = sum(s.nbytes for s in program.steps if isinstance(s, Broadcast))
    return p2p, bcast


def parse_switch_timeout(value: float | int | str | timedelta | SwitchDeadline | None) -> SwitchDeadline | None:
    """``DynaTrainStrategy(switch_timeout=...)``: seconds (a number, or its text from a config file or
    an environment variable), a ``timedelta``, or ``None`` / ``"auto"`` (derived per switch).

    >>> parse_switch_timeout("90").seconds, parse_switch_timeout("auto")
    (90.0, None)

    Raises:
        DynaTrainError: not a positive duration.
    """
    if value is None or isinstance(value, SwitchDeadline):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto", "none"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise DynaTrainError(f"switch_timeout={value!r} is not a number of seconds",
                                 hint="e.g. switch_timeout=120, or auto to derive it from each switch's bytes") from None
    if isinstance(value, timedelta):
        return SwitchDeadline.fixed(value.total_seconds())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DynaTrainError(f"switch_timeout must be seconds (a number), a timedelta or None, got {value!r}",
                             hint="e.g. switch_timeout=120, or None to derive it from each switch's bytes")
    return SwitchDeadline.fixed(value)


__all__ = ["DEFAULT_FLOOR_S", "DEFAULT_MARGIN", "FALLBACK_BYTES_PER_S", "SwitchDeadline", "moved_bytes",
           "parse_switch_timeout"]
