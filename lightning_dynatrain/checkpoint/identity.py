"""What a layout-free checkpoint says about itself, and the checks made before anything is loaded.

Every checkpoint directory carries one ``CheckpointInfo`` (written once, by rank 0, inside the
Lightning part): the format, the model it holds (a digest of the ``ModelSpec``'s state structure
and a readable summary), the precision, the state kinds it holds, and where it was written (layout
and world size: for messages only, a layout-free checkpoint loads at any layout).

The digest covers what decides the state's structure: each logical tensor's name, shape, axis roles,
buffer group, pipeline placement and fp32-ness, and the vocabulary and its padding rule. Two models
with the same digest have the same pieces at every layout; anything else is refused with
``CheckpointMismatchError`` naming the fields that differ.

Example::

    info = CheckpointInfo.of(spec, layout=layout, world_size=4, precision=Precision.FP32,
                             kinds=("param", "exp_avg", "exp_avg_sq"))
    info.check(spec, precision=Precision.FP32, path="ckpt/step=3.ckpt")   # raises on another model
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.spec import ModelSpec, Precision

#: The layout-free format (``checkpoint.logical`` keys, Lightning's dict as one pickled blob).
FORMAT = "dynatrain-logical/1"
#: Summary fields of a ``ModelSpec`` named in messages.
_SUMMARY = ("num_layers", "hidden", "num_heads", "num_query_groups", "head_dim", "ffn_hidden", "vocab_size",
            "make_vocab_size_divisible_by", "num_experts", "moe_ffn_hidden")


class CheckpointError(DynaTrainError):
    """A checkpoint path cannot be read as a checkpoint of this strategy (missing, another format)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint holds another model or precision than the run loading it."""


def spec_digest(spec: ModelSpec) -> str:
    """A stable digest of the state structure of ``spec`` (same in every process and Python run)."""
    tensors = [[t.name, list(t.shape), list(t.axes), t.group.value, t.place.value, t.always_fp32] for t in spec.tensors]
    text = json.dumps({"tensors": tensors, "vocab_size": spec.vocab_size,
                       "make_vocab_size_divisible_by": spec.make_vocab_size_divisible_by}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def spec_summary(spec: ModelSpec) -> dict[str, int]:
    return {name: getattr(spec, name) for name in _SUMMARY}


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """The identity of one layout-free checkpoint (see the module docstring)."""

    format: str
    spec_digest: str
    model: dict
    """``spec_summary`` of the model: what a message names when the digests differ."""
    precision: str
    kinds: tuple[str, ...]
    """State kinds held: ``param`` only for ``save_weights_only``; plus the optimizer's otherwise."""
    layout: str
    world_size: int
    config: dict = field(default_factory=dict)
    """The model's configuration, field by field (``ModelSource.config_record``: a provider's
    ``TransformerConfig``, its functions by name): a run resuming with other values is warned,
    naming them (the state's structure, what must match, is the digest's)."""

    @staticmethod
    def of(spec: ModelSpec, *, layout: object, world_size: int, precision: Precision,
           kinds: tuple[str, ...], config: dict | None = None) -> "CheckpointInfo":
        return CheckpointInfo(format=FORMAT, spec_digest=spec_digest(spec), model=spec_summary(spec),
                              precision=precision.value, kinds=tuple(kinds), layout=str(layout), world_size=world_size,
                              config=dict(config or {}))

    def to_dict(self) -> dict:
        return {**asdict(self), "kinds": list(self.kinds)}

    def config_differences(self, config: dict) -> list[str]:
        """The configuration fields whose values differ from ``config``'s (``field: saved -> now``)."""
        if not self.config or not config:
            return []
        return [f"{k}: {self.config.get(k)} -> {config.get(k)}" for k in sorted(self.config.keys() | config.keys())
                if self.config.get(k) != config.get(k)]

    @staticmethod
    def from_dict(data: dict, *, path: object) -> "CheckpointInfo":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise CheckpointError(f"{path} is not a layout-free DynaTrainStrategy checkpoint (format {found!r}, "
                                  f"expected {FORMAT!r})",
                                  hint="pass a directory written by trainer.save_checkpoint under DynaTrainStrategy")
        fields = {k: data[k] for k in ("format", "spec_digest", "model", "precision", "layout", "world_size")}
        return CheckpointInfo(**fields, kinds=tuple(data["kinds"]), config=dict(data.get("config") or {}))

    def check(self, spec: ModelSpec, *, precision: Precision, path: object) -> None:
        """Raise ``CheckpointMismatchError`` unless this checkpoint holds ``spec``'s state at ``precision``."""
        if self.spec_digest != spec_digest(spec):
            here = spec_summary(spec)
            differ = [f"{k}={self.model.get(k)} (run: {here[k]})" for k in here if self.model.get(k) != here[k]]
            what = ", ".join(differ) if differ else "the same sizes but other tensors (names, axes or options)"
            raise CheckpointMismatchError(
                f"checkpoint {path} holds another model than this run builds: {what}",
                hint="resume with the GPTShape the checkpoint was trained with, or start this model from scratch "
                     "(no ckpt_path)")
        saved = self.precision.split("+")[0]  # the params' dtype (the optimizer's kinds: checked at its load)
        if saved != precision.params:
            raise CheckpointMismatchError(
                f"checkpoint {path} was written with {saved} parameters, this run trains {precision.params}",
                hint=f"resume with Trainer(precision={'bf16-mixed' if saved == 'bf16' else '32-true'!r})")


__all__ = ["FORMAT", "CheckpointError", "CheckpointInfo", "CheckpointMismatchError", "spec_digest", "spec_summary"]
