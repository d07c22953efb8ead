"""Check a layout against a model and a world size; suggest the nearest layouts that fit.

>>> from lightning_dynatrain.vps.presets import preset
>>> validate_layout(ParallelConfig.parse("dp4-tp3-pp1"), preset("llama2-7b"), world_size=12)
Traceback (most recent call last):
...
lightning_dynatrain.vps.errors.LayoutError: layout dp4-tp3-pp1 does not fit llama2-7b: tp=3 must divide the 32 attention heads; tp=3 must divide the 32 query groups; tp=3 must divide the MLP width 11008. HINT: nearest valid layouts for 12 ranks: dp3-tp4-pp1, dp6-tp2-pp1, dp3-tp2-pp2
"""

from __future__ import annotations

import itertools
import math

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import ModelSpec


def layout_problems(layout: ParallelConfig, spec: ModelSpec, world_size: int | None = None) -> list[str]:
    """Every rule ``layout`` breaks for ``spec`` (and ``world_size`` if given); empty when it fits."""
    problems = []
    if world_size is not None and layout.world_size != world_size:
        problems.append(
            f"dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = {layout.world_size} "
            f"must equal the world size {world_size}"
        )
    if spec.derived:
        return problems + _split_problems(layout, spec)
    if spec.num_heads % layout.tp:
        problems.append(f"tp={layout.tp} must divide the {spec.num_heads} attention heads")
    if spec.num_query_groups % layout.tp:
        problems.append(f"tp={layout.tp} must divide the {spec.num_query_groups} query groups")
    if spec.num_experts == 0 or any(t.name.startswith("decoder.layers.mlp.linear_fc") for t in spec.tensors):
        if spec.ffn_hidden % layout.tp:
            problems.append(f"tp={layout.tp} must divide the MLP width {spec.ffn_hidden}")
    for t in spec.tensors:
        if t.name.startswith("decoder.layers.mlp.shared_experts.linear_fc2"):
            width = t.shape[-1]
            if width % layout.tp:
                problems.append(f"tp={layout.tp} must divide the shared expert width {width}")
    problems += _pipeline_problems(layout, spec.num_layers)
    if spec.num_experts:
        if spec.num_experts % layout.ep:
            problems.append(f"ep={layout.ep} must divide the {spec.num_experts} experts")
        if spec.moe_ffn_hidden % layout.etp:
            problems.append(f"etp={layout.etp} must divide the expert MLP width {spec.moe_ffn_hidden}")
    elif layout.ep != 1:
        problems.append(f"ep={layout.ep} needs experts; model {spec.name} is dense")
    return problems


def _pipeline_problems(layout: ParallelConfig, num_layers: int) -> list[str]:
    """The pipeline's rule: its stages take the layers as the layout splits them (even or not)."""
    problem = layout.pipeline_problem(num_layers)
    return [] if problem is None else [problem]


def _split_problems(layout: ParallelConfig, spec: ModelSpec) -> list[str]:
    """The rules of a spec read from a module (``vps.derive``): each split axis divides evenly."""
    from lightning_dynatrain.vps.spec import EXPERT, LAYER, TP, Group

    problems: dict[str, None] = {}
    for t in spec.tensors:
        for extent, role in zip(t.shape, t.axes):
            if role == LAYER:
                problems.update(dict.fromkeys(_pipeline_problems(layout, extent)))
                continue
            size, what = {EXPERT: (layout.ep, "ep"),
                          TP: (layout.etp if t.group is Group.EXPERT else layout.tp,
                               "etp" if t.group is Group.EXPERT else "tp")}.get(role, (1, ""))
            if extent % size:
                problems[f"{what}={size} must divide {t.name}'s {role or 'split'} axis of {extent}"] = None
    if (spec.max_tp or 1) % layout.tp:
        problems[f"tp={layout.tp} must divide {spec.max_tp}, the largest tensor-parallel size the model takes"] = None
    experts = [t for t in spec.tensors if t.group is Group.EXPERT]
    if layout.etp > 1 and experts and not any(TP in t.axes for t in experts):
        problems[f"etp={layout.etp}: megatron refuses expert tensor parallelism for this model"] = None
    if spec.num_experts == 0 and layout.ep != 1:
        problems[f"ep={layout.ep} needs experts; model {spec.name} is dense"] = None
    return list(problems)


def validate_layout(layout: ParallelConfig, spec: ModelSpec, *, world_size: int | None = None) -> ParallelConfig:
    """Return ``layout`` if it fits, else raise ``LayoutError`` naming the rule and nearby valid layouts."""
    problems = layout_problems(layout, spec, world_size)
    if problems:
        world = world_size if world_size is not None else layout.world_size
        near = nearest_layouts(layout, spec, world)
        hint = (f"nearest valid layouts for {world} ranks: {', '.join(map(str, near))}" if near
                else f"no layout of {world} ranks fits {spec.name}; change the number of processes")
        raise LayoutError(f"layout {layout} does not fit {spec.name}: {'; '.join(problems)}", hint=hint)
    return layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_layouts(layout: ParallelConfig, spec: ModelSpec, world_size: int, count: int = 3) -> list[ParallelConfig]:
    """Valid layouts of ``world_size`` ranks closest to ``layout`` (log-distance over the sizes).

    ``cp``, ``zero`` and (where they still fit) ``ep``/``etp`` and the pipeline's uneven ends are
    kept; ``dp``, ``tp``, ``pp`` and ``vpp`` move.
    """
    candidates = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            rest = world_size // (tp * pp)
            if rest % layout.cp:
                continue
            dp = rest // layout.cp
            # the same uneven ends where this pp takes them, else an even split; each vpp up to twice this one
            ends = [(layout.first, layout.last)] if layout.uneven and pp > 1 else []
            for vpp in (range(1, 2 * layout.vpp + 1) if pp > 1 else (1,)):
                for (ep, etp), (first, last) in itertools.product(((layout.ep, layout.etp), (layout.ep, tp), (1, tp)),
                                                                   ends + [(None, None)]):
                    try:
                        cand = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=layout.cp, ep=ep, etp=etp, zero=layout.zero,
                                              first=first, last=last, vpp=vpp)
                    except LayoutError:
                        continue
                    if not layout_problems(cand, spec, world_size):
                        candidates.append(cand)
                        break

    def distance(c: ParallelConfig) -> tuple[float, str]:
        d = sum(abs(math.log2(getattr(c, a) / getattr(layout, a))) for a in ("dp", "tp", "pp", "ep", "etp", "vpp"))
        return (d, str(c))

    return sorted(set(candidates), key=distance)[:count]
