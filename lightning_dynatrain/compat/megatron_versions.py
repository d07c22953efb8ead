"""What differs between the megatron-core releases this package supports (0.16.1 to 0.19) in its
public API, in one place for the package and for users' model code.

A layer spec's MLP: a ``ModuleSpec`` with ``submodules`` up to 0.16, from 0.19 a
``functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))``. ``mlp_submodules``
returns the ``MLPSubmodules`` either way, so a user's layer (``linear_fc1 = GateUpLinear``) goes in
the same way on both.

``DistributedDataParallel`` with the distributed optimizer: 0.19 wants the caller to compute the
buffers' parameter layout (``DistributedOptimizer.compute_full_param_layout``, passed as
``full_param_layout``) and warns when DDP has to; 0.16 has neither. ``ddp_layout_kwargs`` gives what
the installed release takes.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any


def mlp_submodules(layer_spec: Any) -> Any:
    """The ``MLPSubmodules`` of a megatron ``TransformerLayer`` spec's dense MLP (to read or replace
    ``linear_fc1``/``linear_fc2``), on every supported megatron-core."""
    mlp = layer_spec.submodules.mlp
    found = mlp.keywords.get("submodules") if isinstance(mlp, partial) else getattr(mlp, "submodules", None)
    if found is None or not hasattr(found, "linear_fc1"):
        raise TypeError(f"the layer spec's mlp ({mlp!r}) has no MLPSubmodules: mlp_submodules reads a dense "
                        "MLP's spec (megatron's get_gpt_layer_*_spec without experts)")
    return found


def ddp_layout_kwargs(model: Any, ddp_config: Any, pg_collection: Any) -> dict[str, Any]:
    """Keyword arguments for megatron's ``DistributedDataParallel(module=model, ...)`` that lay out its
    buffers for the distributed optimizer, computed as megatron's own training does
    (``wrap_model_chunks_with_ddp``): ``{"full_param_layout": ...}`` on a release that takes it
    and with ``use_distributed_optimizer``, else ``{}``. The layout is DDP's own: buckets only with
    ``overlap_grad_reduce`` (DDP drops them otherwise), shards over the intra-instance data-parallel
    groups."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    compute = getattr(DistributedOptimizer, "compute_full_param_layout", None)
    takes = "full_param_layout" in inspect.signature(DistributedDataParallel.__init__).parameters
    if compute is None or not takes or not ddp_config.use_distributed_optimizer:
        return {}
    if ddp_config.overlap_grad_reduce:
        raise NotImplementedError("ddp_layout_kwargs lays out one bucket per buffer (overlap_grad_reduce=False); "
                                  "with overlap, DDP's bucket sizes per pipeline stage would have to be repeated here")
    dense = getattr(pg_collection, "intra_dp_cp", None) or pg_collection.dp_cp
    expert = getattr(pg_collection, "intra_expt_dp", None) or getattr(pg_collection, "expt_dp", None)
    params = [p for p in model.parameters() if p.requires_grad]
    layout = compute(params, None, dense.size(), ddp_config,
                     expert_data_parallel_world_size=expert.size() if expert is not None else None)
    return {"full_param_layout": layout}


__all__ = ["ddp_layout_kwargs", "mlp_submodules"]
