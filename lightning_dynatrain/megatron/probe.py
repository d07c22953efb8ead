"""Build a model at any layout and rank without processes or memory, to read its description.

A *probe* is this rank's module of some other layout, built on the meta device (no storage, no
initialisation) on groups that only know their rank and size
(``compat.torch_internals.fake_process_group``): what megatron's constructors ask. Megatron's
parallel-state globals answer with the same groups while a probe is built and read
(``compat.megatron_internals.groups_as_globals``), for modules that read them.

``probe_module`` builds the few probes ``vps.derive`` reads: everything on one rank
(``dp1-tp1-pp1``), then tp, pp and ep ranks 0 and 1 of the smallest size > 1 each dimension builds
at (a model with 3 heads probes tp at 3). A size no layout of the model can use (the build raises)
is not probed: the model never runs at it. Every rank makes the same probes.

Example (inside a job whose megatron groups are initialised: megatron reads the current ones in a
few places, e.g. a tied embedding's replica id)::

    probes = probe_module(lambda layout, groups: build(layout, groups), has_experts=True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from lightning_dynatrain.compat.megatron_internals import groups_as_globals
from lightning_dynatrain.compat.torch_internals import fake_process_group
from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.describe import describe_module
from lightning_dynatrain.vps.derive import Probes
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.shards import ModuleDescription

_log = logging.getLogger(__name__)

#: ``build(layout, groups)``: this rank's module at ``layout`` on ``groups`` (a
#: ``ProcessGroupCollection``), with no weight initialisation; called under the meta device.
ProbeBuild = Callable[[ParallelConfig, ProcessGroupCollection], torch.nn.Module]
#: the sizes tried for each dimension, smallest first
_SIZES = (2, 3, 5, 7)


def probe_groups(layout: ParallelConfig, rank: int) -> ProcessGroupCollection:
    """``rank``'s groups of ``layout`` as megatron makes them (order tp-cp-ep-dp-pp), each a fake
    group of the right rank and size. No embedding groups: a probe runs no construction collective."""
    d, e = layout.dense_coord(rank), layout.expert_coord(rank)
    tp, cp, dp, pp = layout.tp, layout.cp, layout.dp, layout.pp
    etp, ep, edp = layout.etp, layout.ep, layout.edp
    g = fake_process_group
    return ProcessGroupCollection(
        tp=g(d.tp, tp), cp=g(d.cp, cp), dp=g(d.dp, dp), pp=g(d.pp, pp), dp_cp=g(layout.dp_cp_index(rank), dp * cp),
        tp_cp=g(d.tp + tp * d.cp, tp * cp), mp=g(d.tp + tp * d.cp + tp * cp * d.pp, tp * cp * pp),
        tp_dp_cp=g(d.tp + tp * (d.cp + cp * d.dp), tp * cp * dp),
        ep=g(e.ep, ep), expt_tp=g(e.etp, etp), expt_dp=g(e.edp, edp), tp_ep=g(e.etp + etp * e.ep, etp * ep),
        tp_ep_pp=g(e.etp + etp * (e.ep + ep * e.pp), etp * ep * pp), intra_dp_cp=g(layout.dp_cp_index(rank), dp * cp),
        intra_expt_dp=g(e.edp, edp), embd=None, pos_embd=None)


def describe_at(build: ProbeBuild, layout: ParallelConfig, rank: int, *, as_globals: bool = True) -> ModuleDescription:
    """``rank``'s module at ``layout``, built storage-free, and what it says it holds. Megatron's
    globals answer with the probe's groups meanwhile (``as_globals=False``: they stay the current
    layout's, to find out whether the module reads them)."""
    groups = probe_groups(layout, rank)
    with groups_as_globals(groups) if as_globals else nullcontext():
        with torch.device("meta"), device_kind("meta").megatron_context():
            module = build(layout, groups)
        return describe_module(module, layout=layout, rank=rank, dp_cp_group=groups.dp_cp)


def _pair(build: ProbeBuild, layouts: list[ParallelConfig], ranks: Callable[[ParallelConfig], tuple[int, int]],
          what: str) -> tuple[ModuleDescription, ModuleDescription] | None:
    for layout in layouts:
        try:
            return tuple(describe_at(build, layout, r) for r in ranks(layout))  # type: ignore[return-value]
        except (AssertionError, ValueError, RuntimeError, LayoutError, ZeroDivisionError) as err:
            _log.debug("no %s probe at %s: %s", what, layout, err)
    return None


def probe_module(build: ProbeBuild, *, has_experts: bool) -> Probes:
    """The probes ``vps.derive.derive_spec`` reads (see the module docstring), and whether the
    module reads megatron's globals (``Probes.reads_globals``): the last probe built again with the
    globals left at the current layout's, compared.

    Raises:
        whatever the build raises at ``dp1-tp1-pp1`` (a model that cannot be built at all).
    """
    base = describe_at(build, ParallelConfig(), 0)
    # experts cut by etp with tp; where megatron refuses that (0.16: expert biases), by ep beside tp
    tp_layouts = [ParallelConfig(tp=n) for n in _SIZES]
    if has_experts:
        tp_layouts = [lay for n in _SIZES for lay in (ParallelConfig(tp=n), ParallelConfig(tp=n, ep=n, etp=1))]
    tp = _pair(build, tp_layouts, lambda layout: (0, 1), "tp")
    pp = _pair(build, [ParallelConfig(pp=n) for n in _SIZES], lambda layout: (0, layout.pp - 1), "pp")
    ep = _pair(build, [ParallelConfig(dp=n, ep=n, etp=1) for n in _SIZES], lambda layout: (0, 1), "ep") \
        if has_experts else None
    last = next((pair[1] for pair in (tp, pp, ep) if pair is not None), None)
    reads_globals = last is not None and describe_at(build, last.layout, last.rank, as_globals=False) != last
    return Probes(base=base, tp=tp, pp=pp, ep=ep, reads_globals=reads_globals)


__all__ = ["ProbeBuild", "describe_at", "probe_groups", "probe_module"]
