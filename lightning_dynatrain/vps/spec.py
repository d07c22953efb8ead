"""Logical tensors of a Megatron-core GPT (dense or MoE): names, shapes and which axis each parallel
dimension splits. Everything here is independent of any layout.

Parallel axes are collapsed into logical axes (DESIGN.md):

- ``layer``  the global layer index; pipeline parallelism splits it into contiguous stages.
- ``expert`` the global expert index; expert parallelism splits it into contiguous ranges.
- ``tp``     the axis tensor parallelism splits (expert tensors: expert tensor parallelism).
- ``vocab``  a vocabulary axis split by tensor parallelism after Megatron pads it (see ``padded_vocab``).
             Its logical extent is the largest padded size any valid layout uses (``vocab_rows``):
             Megatron trains padding rows like any other (they enter the softmax), so the rows two
             layouts share move like the rest; rows only the destination has are a named
             don't-care region (``RankPlan.fills``), zeroed, never silently dropped.
- ``""``     not split (replicated over the parallel dimensions).

Leading ``layer``/``expert`` axes index *separate* local tensors (``decoder.layers.3...``); the
remaining axes, reshaped, are one local tensor. Example: Megatron's fused QKV weight is
``[layers, groups, q_per_group + 2, head_dim, hidden]`` with tp on ``groups``; at tp=2 the local tensor
of layer 3 is that box reshaped to ``[(groups/2) * (q_per_group+2) * head_dim, hidden]``.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field

from lightning_dynatrain.vps.errors import ModelSpecError

LAYER = "layer"
EXPERT = "expert"
TP = "tp"
VOCAB = "vocab"
NONE = ""
_ROLES = (LAYER, EXPERT, TP, VOCAB, NONE)


class Place(str, enum.Enum):
    """Which pipeline stages hold a tensor."""

    LAYERS = "layers"  # one slice per stage along the layer axis
    FIRST = "first"  # first stage only (embeddings)
    LAST = "last"  # last stage only (final norm, untied output layer)
    FIRST_AND_LAST = "first+last"  # tied embedding: first stage and Megatron's copy on the last


class Group(str, enum.Enum):
    """Which buffer and mesh a tensor belongs to: dense (dp x cp x tp) or expert (edp x ep x etp)."""

    DENSE = "dense"
    EXPERT = "expert"


class StateKind(str, enum.Enum):
    """A piece of training state kept per parameter element."""

    PARAM = "param"
    MAIN_PARAM = "main_param"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    MOMENTUM = "momentum_buffer"
    """SGD's momentum (torch's ``momentum_buffer``)."""

    def __str__(self) -> str:
        return self.value

    @property
    def is_optimizer_state(self) -> bool:
        """Kept by the optimizer per element (moments), not a parameter or its main copy."""
        return self in (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ, StateKind.MOMENTUM)


#: the optimizers' per-element state kinds (megatron's ``OptimizerConfig.optimizer``)
_OPTIMIZER_KINDS = {"adam": (StateKind.EXP_AVG, StateKind.EXP_AVG_SQ), "sgd": (StateKind.MOMENTUM,)}


class Precision(str, enum.Enum):
    """How state is stored: which kinds exist and how many bytes per element each takes, by the
    params' dtype and the optimizer.

    ``bf16``: bf16 params with fp32 main params and Adam moments (how large runs train). A tensor
    megatron keeps in fp32 even then (``LogicalTensor.always_fp32``: the local layer spec's norms)
    has fp32 params, no main param, and lives in megatron's fp32 buffer.
    ``fp32``: fp32 params (the optimizer updates them directly, Megatron keeps no main copy).
    ``bf16+sgd``, ``fp32+sgd``: the same with SGD, whose state is one momentum per element.
    """

    BF16 = "bf16"
    FP32 = "fp32"
    BF16_SGD = "bf16+sgd"
    FP32_SGD = "fp32+sgd"

    @staticmethod
    def of_state(*, params: str, optimizer: str = "adam") -> "Precision":
        """The precision of ``params`` (``"bf16"`` or ``"fp32"``) trained by ``optimizer`` (``"adam"``, ``"sgd"``)."""
        return Precision(params if optimizer == "adam" else f"{params}+{optimizer}")

    @property
    def params(self) -> str:
        """The params' dtype: ``"bf16"`` or ``"fp32"``."""
        return self.value.split("+")[0]

    @property
    def optimizer(self) -> str:
        """The optimizer whose state is kept: ``"adam"`` or ``"sgd"``."""
        return self.value.split("+")[1] if "+" in self.value else "adam"

    @property
    def kinds(self) -> tuple[tuple[StateKind, int], ...]:
        """The state kinds of a parameter stored at this precision, with bytes per element."""
        return _kinds(self)

    def of(self, tensor: "LogicalTensor") -> "Precision":
        """The precision ``tensor`` is stored at: this one, or fp32 for an ``always_fp32`` tensor."""
        return _fp32_of(self) if tensor.always_fp32 else self

    def kinds_of(self, tensor: "LogicalTensor") -> tuple[tuple[StateKind, int], ...]:
        """``kinds`` of one tensor (see ``of``)."""
        return self.of(tensor).kinds

    @property
    def bytes_per_element(self) -> int:
        return sum(b for _, b in self.kinds)

    def element_size(self, kind: StateKind, tensor: "LogicalTensor | None" = None) -> int:
        """Bytes per element of ``kind`` (of ``tensor``, when given: see ``of``)."""
        for k, b in (self.kinds if tensor is None else self.kinds_of(tensor)):
            if k is kind:
                return b
        raise KeyError(f"state kind {kind} does not exist at precision {self.value}"
                       + (f" for {tensor.name}" if tensor is not None else ""))

    def dtype_name(self, kind: StateKind, tensor: "LogicalTensor") -> str:
        """The torch dtype's name (``"bfloat16"``, ``"float32"``) of ``kind`` of ``tensor``."""
        return "bfloat16" if self.element_size(kind, tensor) == 2 else "float32"


@functools.cache  # (the planner asks for every piece of every tensor: computed once per precision)
def _kinds(precision: Precision) -> tuple[tuple[StateKind, int], ...]:
    moments = tuple((kind, 4) for kind in _OPTIMIZER_KINDS[precision.optimizer])
    if precision.params == "bf16":
        return ((StateKind.PARAM, 2), (StateKind.MAIN_PARAM, 4), *moments)
    return ((StateKind.PARAM, 4), *moments)


@functools.cache
def _fp32_of(precision: Precision) -> Precision:
    return Precision.of_state(params="fp32", optimizer=precision.optimizer)


#: Optimizer scalars: identical on every rank, kept out of the box plan and carried whole.
SCALAR_STATE = ("optimizer.step", "scheduler.last_epoch", "data.consumed_samples")


@dataclass(frozen=True, slots=True)
class LogicalTensor:
    """One parameter of the model in the VPS, whole, whatever the layout.

    Attributes:
        name: layout-independent name, layers and experts collapsed (``decoder.layers.mlp.linear_fc1.weight``).
        shape: logical shape, leading ``layer``/``expert`` axes first.
        axes: role of each axis (``layer``, ``expert``, ``tp``, ``vocab`` or ``""``).
        group: dense or expert (which optimizer buffer and which mesh).
        place: which pipeline stages hold it.
        megatron_name: the parameter name in a Megatron ``GPTModel`` with ``{layer}``/``{expert}``
            placeholders for the *stage-local* layer and *rank-local* expert index.
        last_stage_name: for a tied embedding, the name of Megatron's copy on the last stage.
        always_fp32: see the field.
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    group: Group
    place: Place
    megatron_name: str
    last_stage_name: str | None = None
    always_fp32: bool = False
    """Megatron keeps the parameter in fp32 under mixed precision (no separate main param): the
    local layer spec's norms, plain torch modules built without a dtype."""
    stack_axes: int = field(init=False, default=0, compare=False)
    """Number of leading axes that index separate local tensors (layer, then expert)."""

    def __post_init__(self) -> None:
        n = 0
        for role in self.axes:
            if role not in (LAYER, EXPERT):
                break
            n += 1
        object.__setattr__(self, "stack_axes", n)
        if len(self.shape) != len(self.axes):
            raise ModelSpecError(f"{self.name}: shape {self.shape} and axes {self.axes} differ in length")
        if any(r not in _ROLES for r in self.axes):
            raise ModelSpecError(f"{self.name}: unknown axis role in {self.axes}", hint=f"roles are {_ROLES}")
        split = [r for r in self.axes if r]
        if len(split) != len(set(split)):
            raise ModelSpecError(f"{self.name}: an axis role is used twice in {self.axes}")
        if (LAYER in self.axes) != (self.place is Place.LAYERS):
            raise ModelSpecError(f"{self.name}: a layer axis goes with place=layers and only with it")
        if self.stack_axes != len([r for r in self.axes if r in (LAYER, EXPERT)]):
            raise ModelSpecError(f"{self.name}: layer/expert axes must lead the shape, got {self.axes}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def axis_of(self, role: str) -> int | None:
        return self.axes.index(role) if role in self.axes else None


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Every logical tensor of one model, in Megatron's parameter registration order.

    ``pre``, ``layer`` and ``post`` tensors are listed in the order a Megatron ``GPTModel`` registers
    them (embedding; per layer; final norm and output layer): the distributed optimizer's flat buffer
    follows that order (reversed), so the zero1 mapping depends on it.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    make_vocab_size_divisible_by: int
    num_experts: int
    moe_ffn_hidden: int
    tensors: tuple[LogicalTensor, ...]
    published_parameters: int | None = None
    max_tp: int | None = None
    """The largest tensor-parallel size any layout may use, when the sizes above do not say it (a
    description read from a megatron module, ``vps.derive``: ``num_heads`` and friends are then
    informative only, and the layout rules are those of its split axes)."""
    by_name: dict = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]
    _hash: int = field(default=0, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(names) != len(set(names)):
            raise ModelSpecError(f"model {self.name}: duplicate logical tensor names")
        object.__setattr__(self, "by_name", {t.name: t for t in self.tensors})
        # specs key every planner cache: hash the tensors once, not at every lookup
        object.__setattr__(self, "_hash", hash((self.name, self.tensors)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def parameters(self) -> int:
        """Parameters of the model, counting the true vocabulary (not Megatron's padding rows)."""
        total = 0
        for t in self.tensors:
            axis = t.axis_of(VOCAB)
            total += t.numel if axis is None else t.numel // t.shape[axis] * self.vocab_size
        return total

    @property
    def vocab_rows(self) -> int:
        """Logical extent of a vocabulary axis: the padding at the largest valid tp (tp divides the
        query groups, or ``max_tp``; every smaller valid tp pads to at most this many rows)."""
        return self.padded_vocab(self.max_tp or self.num_query_groups)

    @property
    def derived(self) -> bool:
        """Read from a megatron module's own description (``vps.derive``), not written for a GPT."""
        return self.max_tp is not None

    def tensor(self, name: str) -> LogicalTensor:
        try:
            return self.by_name[name]
        except KeyError:
            raise ModelSpecError(f"model {self.name} has no logical tensor {name!r}") from None

    def padded_vocab(self, tp: int) -> int:
        """Megatron's rule: pad the vocabulary to a multiple of ``make_vocab_size_divisible_by * tp``."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def state_bytes(self, precision: Precision, *, weights_only: bool = False) -> int:
        """Bytes of one full logical copy of params and optimizer state (``weights_only``: of the
        params alone, in the dtype they train in)."""
        total = 0
        for t in self.tensors:
            axis = t.axis_of(VOCAB)
            numel = t.numel if axis is None else t.numel // t.shape[axis] * self.vocab_size
            each = precision.element_size(StateKind.PARAM, t) if weights_only else precision.of(t).bytes_per_element
            total += numel * each
        return total

    def itemsize(self, tensor: str, kind: StateKind, precision: Precision) -> int:
        """Bytes per element of ``kind`` of the logical tensor named ``tensor`` at ``precision``."""
        return precision.element_size(kind, self.by_name[tensor])
