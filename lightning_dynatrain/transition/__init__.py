"""The state transition engine: moves a rank's state from one parallel layout to another.

The planner (``lightning_dynatrain.vps``) says which boxes each rank sends, receives and keeps; the
engine compiles that into a program of steps (``compile_switch``: pure, cacheable, printable) and
walks it (``execute_switch``): local copies for what stays, promoted broadcasts where they pay, an
XOR pairwise schedule of staged point-to-point exchanges for the rest, within a byte budget, with
memory allocated and freed through a policy (``lightning_dynatrain.devices.memory_policy``).

Files, one concept each: ``program`` (the steps), ``compiler`` (``compile_switch``), ``walker``
(``execute_switch``), ``memory_fold`` (the memory a program takes), ``store`` (local tensors and box
views), ``schedule`` (XOR steps), ``staging`` (byte budget and stages), ``packing`` (pack/unpack),
``adoption`` (tensors kept in place), ``collectives`` (broadcast promotion and link costs),
``preflight`` (checks agreed before anything moves), ``report`` (``SwitchReport``).
"""

from lightning_dynatrain.transition.adoption import adoptable_keys
from lightning_dynatrain.transition.collectives import (
    BroadcastJob,
    BroadcastPlan,
    LinkCosts,
    SubgroupCache,
    SubgroupNamingError,
    measure_link_costs,
    plan_broadcasts,
)
from lightning_dynatrain.transition.compiler import DIRECT_MIN_BYTES, compile_switch
from lightning_dynatrain.transition.errors import (
    EngineInternalError,
    StagingBudgetError,
    StateStoreError,
    SwitchAbortedError,
)
from lightning_dynatrain.transition.memory_fold import switch_peak_bytes
from lightning_dynatrain.transition.program import SwitchProgram
from lightning_dynatrain.transition.report import PrimitiveStats, SwitchReport
from lightning_dynatrain.transition.schedule import Step, active_steps, next_pow2, xor_schedule
from lightning_dynatrain.transition.staging import format_bytes, parse_bytes, plan_stages, split_box
from lightning_dynatrain.transition.local_state import LocalStore, RegionIndex, StoreKey, box_view
from lightning_dynatrain.transition.walker import execute_switch

__all__ = [
    "BroadcastJob",
    "BroadcastPlan",
    "DIRECT_MIN_BYTES",
    "EngineInternalError",
    "LinkCosts",
    "LocalStore",
    "PrimitiveStats",
    "RegionIndex",
    "StagingBudgetError",
    "StateStoreError",
    "Step",
    "StoreKey",
    "SubgroupCache",
    "SubgroupNamingError",
    "SwitchAbortedError",
    "SwitchProgram",
    "SwitchReport",
    "active_steps",
    "adoptable_keys",
    "box_view",
    "compile_switch",
    "execute_switch",
    "format_bytes",
    "measure_link_costs",
    "next_pow2",
    "parse_bytes",
    "plan_broadcasts",
    "plan_stages",
    "split_box",
    "switch_peak_bytes",
    "xor_schedule",
]
