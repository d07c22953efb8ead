"""Parallel layouts: how many ways each parallel axis splits the job, and which rank sits where.

A layout is written ``dp2-tp2-pp1`` with optional ``-cpN``, ``-epN``, ``-etpN`` (expert tensor
parallel, defaults to ``tp``), ``-zero1`` (optimizer state sharded over data-parallel ranks as
Megatron's distributed optimizer does; ``zero0`` keeps it replicated) and, for an uneven pipeline,
``-firstN`` / ``-lastN``: N transformer layers on the first / last stage, the rest split evenly over
the stages between (megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``), e.g.
``dp1-tp1-pp4-first1-last1`` puts 1, 3, 3, 1 of 8 layers on its stages; ``-vppN``: N virtual stages
per pipeline rank (megatron's interleaved schedule, ``virtual_pipeline_model_parallel_size``): each
stage's layers in N model chunks, dealt round-robin, so ``dp1-tp1-pp2-vpp2`` puts layers 0-1 and 4-5 of
8 on rank 0 and 2-3 and 6-7 on rank 1 (``layer_cuts``).

Rank coordinates follow Megatron-core's ``RankGenerator`` with order ``tp-cp-ep-dp-pp`` so that the
groups built here are the groups ``parallel_state.initialize_model_parallel`` builds:

- dense mesh ``(tp, cp, dp, pp)``: ``rank = tp + TP * (cp + CP * (dp + DP * pp))``
- expert mesh ``(etp, ep, edp, pp)``: ``rank = etp + ETP * (ep + EP * (edp + EDP * pp))``

Example, ``dp2-tp2-pp2`` (8 ranks)::

    rank:  0  1  2  3  4  5  6  7
    tp:    0  1  0  1  0  1  0  1
    dp:    0  0  1  1  0  0  1  1
    pp:    0  0  0  0  1  1  1  1
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import NamedTuple

from lightning_dynatrain.vps.errors import LayoutError

_TOKEN = re.compile(r"^(dp|tp|pp|vpp|cp|ep|etp|zero|first|last)(\d+)$")


class DenseCoord(NamedTuple):
    """Position of a rank on the dense (non-expert) mesh."""

    tp: int
    cp: int
    dp: int
    pp: int


class ExpertCoord(NamedTuple):
    """Position of a rank on the expert mesh (expert tensor, expert, expert-data, pipeline)."""

    etp: int
    ep: int
    edp: int
    pp: int


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """One parallel layout. Sizes only; validation against a model lives in ``validate``.

    Attributes:
        dp: data-parallel replicas (of the dense part).
        tp: tensor-parallel ranks (Megatron column/row/vocab parallel split).
        pp: pipeline stages (contiguous blocks of layers, equal unless ``first``/``last`` say otherwise).
        cp: context-parallel ranks (sequence split; parameters are replicated over cp).
        ep: expert-parallel ranks (experts split in contiguous ranges).
        etp: expert tensor-parallel ranks; ``None`` means "same as tp".
        zero: 0 = optimizer state replicated over data parallel, 1 = sharded (distributed optimizer).
        first: transformer layers on the first pipeline stage; ``None``: an even share.
        last: transformer layers on the last pipeline stage; ``None``: an even share.
        vpp: virtual pipeline stages (model chunks) per pipeline rank; 1: no interleaving.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    zero: int = 0
    first: int | None = None
    last: int | None = None
    vpp: int = 1

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(
                    f"layout size {name}={value!r} is not a positive integer",
                    hint=f"write e.g. '{name}1'",
                )
        if self.zero not in (0, 1):
            raise LayoutError(
                f"zero={self.zero!r} is not supported",
                hint="use zero0 (replicated optimizer state) or zero1 (sharded over data parallel)",
            )
        for name in ("first", "last"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r}: a stage holds at least one layer",
                                  hint=f"write e.g. '{name}1', or leave {name} out for an even split")
            if self.pp == 1:
                raise LayoutError(f"{name}{value} needs a pipeline: pp is 1",
                                  hint=f"use pp2 or more with {name}{value}, or leave {name} out")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp{self.vpp} needs a pipeline: pp is 1",
                              hint=f"use pp2 or more with vpp{self.vpp}, or leave vpp out")
        if self.ep == 1 and self.etp != self.tp:
            raise LayoutError(
                f"etp={self.etp} differs from tp={self.tp} without expert parallelism",
                hint="set etp equal to tp, or use ep > 1 (Megatron keeps expert weights in the dense "
                "optimizer buffer when ep == 1)",
            )
        expert_capacity = self.tp * self.cp * self.dp
        if expert_capacity % (self.etp * self.ep) != 0:
            raise LayoutError(
                f"expert groups do not fit: etp*ep = {self.etp}*{self.ep} must divide "
                f"tp*cp*dp = {expert_capacity}",
                hint="choose ep and etp so that etp*ep divides tp*cp*dp",
            )

    # ----------------------------------------------------------------- sizes
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each expert shard."""
        return (self.tp * self.cp * self.dp) // (self.etp * self.ep)

    @property
    def uneven(self) -> bool:
        """Whether the first or the last pipeline stage has a layer count of its own."""
        return self.first is not None or self.last is not None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """How many of ``num_layers`` transformer layers each pipeline stage holds, as megatron builds
        them (``get_num_layers_to_build``): ``first``/``last`` on the end stages, the rest evenly.

        >>> ParallelConfig.parse("pp4-first1-last1").stage_layers(8)
        (1, 3, 3, 1)

        Raises:
            LayoutError: the layers do not split so, with the nearest layouts that do.
        """
        problem = self.pipeline_problem(num_layers)
        if problem is not None:
            raise LayoutError(f"layout {self}: {problem}", hint=self._nearest_splits(num_layers))
        middle_stages = self.pp - (self.first is not None) - (self.last is not None)
        middle = num_layers - (self.first or 0) - (self.last or 0)
        each = middle // middle_stages if middle_stages else 0
        counts = [each] * self.pp
        if self.first is not None:
            counts[0] = self.first
        if self.last is not None:
            counts[-1] = self.last
        return tuple(counts)

    def pipeline_problem(self, num_layers: int) -> str | None:
        """Why the stages cannot take ``num_layers`` layers as this layout splits them; ``None`` if they can."""
        if not self.uneven:
            if num_layers % (self.pp * self.vpp) == 0:
                return None
            if self.vpp == 1:
                return f"pp={self.pp} must divide the {num_layers} layers"
            return f"pp*vpp = {self.pp}*{self.vpp} must divide the {num_layers} layers"
        middle_stages = self.pp - (self.first is not None) - (self.last is not None)
        middle = num_layers - (self.first or 0) - (self.last or 0)
        if middle < 0 or bool(middle) != bool(middle_stages) or (middle_stages and middle % middle_stages):
            return (f"its end stages leave {middle} of the {num_layers} layers to {middle_stages} middle stage(s): "
                    f"that must be a positive multiple of them (none with no middle stage)")
        if self.vpp > 1 and not middle_stages:
            return (f"with vpp={self.vpp} megatron-core places no layers when both end stages are given and no "
                    f"stage is between them (its layer offset divides by the middle stages): give first or last alone")
        counts = {"first": self.first, "last": self.last, "each middle": middle // middle_stages if middle_stages else 0}
        uneven_chunks = [f"{name} {n}" for name, n in counts.items() if n and n % self.vpp]
        if uneven_chunks:
            return f"vpp={self.vpp} must divide each stage's layers ({', '.join(uneven_chunks)})"
        return None

    def layer_cuts(self, num_layers: int) -> tuple[int, ...]:
        """The layers cut into ``pp * vpp`` contiguous blocks, in order: block ``k`` is
        ``[cuts[k], cuts[k + 1])``, model chunk ``k // pp`` of pipeline rank ``k % pp``, each a
        ``vpp``-th of its stage's layers (megatron's ``get_transformer_layer_offset``). Without
        virtual stages, the stages' own bounds.

        >>> ParallelConfig.parse("pp2-vpp2").layer_cuts(8)
        (0, 2, 4, 6, 8)
        """
        per_chunk = [count // self.vpp for count in self.stage_layers(num_layers)]
        cuts = [0]
        for _ in range(self.vpp):
            for count in per_chunk:
                cuts.append(cuts[-1] + count)
        return tuple(cuts)

    def chunk_layers(self, num_layers: int, stage: int) -> int:
        """Layers in each model chunk of pipeline rank ``stage``."""
        return self.stage_layers(num_layers)[stage] // self.vpp

    def _nearest_splits(self, num_layers: int) -> str:
        """Up to three layouts with this pp (this vpp first) whose stages take ``num_layers`` layers,
        the closest first."""
        options = []
        for vpp in dict.fromkeys((self.vpp, 1)):
            even = self.replace(first=None, last=None, vpp=vpp)
            ends = [(None, None)] + [(f, l) for f in range(1, num_layers + 1) for l in range(1, num_layers + 1 - f)]
            for first, last in ends:
                candidate = even.replace(first=first, last=last)
                if candidate.pipeline_problem(num_layers) is None:
                    far = abs((first or 0) - (self.first or 0)) + abs((last or 0) - (self.last or 0))
                    options.append((vpp != self.vpp, first is not None, far, candidate))
        if not options:
            return f"no split of {num_layers} layers over {self.pp} stages exists: choose another pp"
        options.sort(key=lambda o: o[:3])
        return "e.g. " + ", ".join(str(o[-1]) for o in options[:3])

    @property
    def dp_cp(self) -> int:
        """Size of the group the dense distributed optimizer shards over (dp x cp)."""
        return self.dp * self.cp

    # ----------------------------------------------------------- coordinates
    def dense_coord(self, rank: int) -> DenseCoord:
        self._check_rank(rank)
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return DenseCoord(tp, cp, dp, pp)

    def dense_rank(self, coord: DenseCoord) -> int:
        tp, cp, dp, pp = coord
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def expert_coord(self, rank: int) -> ExpertCoord:
        self._check_rank(rank)
        etp, rest = rank % self.etp, rank // self.etp
        ep, rest = rest % self.ep, rest // self.ep
        edp, pp = rest % self.edp, rest // self.edp
        return ExpertCoord(etp, ep, edp, pp)

    def expert_rank(self, coord: ExpertCoord) -> int:
        etp, ep, edp, pp = coord
        return etp + self.etp * (ep + self.ep * (edp + self.edp * pp))

    def dp_cp_index(self, rank: int) -> int:
        """Rank within the dense data-parallel-with-context group (Megatron's ``dp_cp`` group)."""
        c = self.dense_coord(rank)
        return c.cp + self.cp * c.dp

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside layout {self} of world size {self.world_size}")

    # ---------------------------------------------------------- string form
    def __str__(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp != 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp != 1:
            parts.append(f"cp{self.cp}")
        if self.ep != 1:
            parts.append(f"ep{self.ep}")
        if self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.first is not None:
            parts.append(f"first{self.first}")
        if self.last is not None:
            parts.append(f"last{self.last}")
        return "-".join(parts)

    @classmethod
    def parse(cls, text: "str | ParallelConfig") -> "ParallelConfig":
        """Parse ``dp2-tp2-pp1[-vppN][-cpN][-epN][-etpN][-zero1][-firstN][-lastN]``; omitted sizes are 1.

        >>> str(ParallelConfig.parse("tp2-dp2-zero1"))
        'dp2-tp2-pp1-zero1'
        """
        if isinstance(text, ParallelConfig):
            return text
        if not isinstance(text, str) or not text.strip():
            raise LayoutError(
                f"cannot parse layout {text!r}", hint="write a layout like 'dp2-tp2-pp1' or 'dp4-tp1-pp1-zero1'"
            )
        values: dict[str, int] = {}
        for token in text.strip().lower().split("-"):
            match = _TOKEN.match(token)
            if match is None:
                raise LayoutError(
                    f"cannot parse layout {text!r}: unknown part {token!r}",
                    hint="parts are dpN, tpN, ppN, vppN, cpN, epN, etpN, zero0/zero1, firstN, lastN joined by '-', "
                    "e.g. 'dp2-tp2-pp1'",
                )
            name, number = match.group(1), int(match.group(2))
            if name in values:
                raise LayoutError(f"cannot parse layout {text!r}: {name} is given twice", hint="give each size once")
            values[name] = number
        return cls(**values)

    def replace(self, **changes: int | None) -> "ParallelConfig":
        return dataclasses.replace(self, **changes)


def as_layout(value: "str | ParallelConfig") -> ParallelConfig:
    """Accept a layout or its string form."""
    return ParallelConfig.parse(value)


__all__ = ["DenseCoord", "ExpertCoord", "ParallelConfig", "as_layout"]
