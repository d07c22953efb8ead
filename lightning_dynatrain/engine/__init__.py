"""The state transition engine: moves a rank's state from one parallel layout to another.

The planner (``lightning_dynatrain.vps``) says which boxes each rank sends, receives and keeps; the
engine only moves bytes: local copies for what stays, promoted broadcasts where they pay, and an XOR
pairwise schedule of staged point-to-point exchanges for the rest, within a byte budget.

Files, one concept each: ``store`` (local tensors and box views), ``schedule`` (XOR steps),
``staging`` (byte budget and stages), ``packing`` (pack/unpack), ``adoption`` (tensors kept in
place), ``collectives`` (broadcast promotion and link costs), ``preflight`` (checks agreed before
anything moves), ``report`` (``SwitchReport``), ``engine`` (``execute_switch``), ``memory_plan``
(the memory a switch takes, replayed from the plan), ``recycling`` (new state carved out of old
storages, for CPU memory).
"""

from lightning_dynatrain.engine.collectives import (
    BroadcastJob,
    BroadcastPlan,
    LinkCosts,
    SubgroupCache,
    measure_link_costs,
    plan_broadcasts,
)
from lightning_dynatrain.engine.adoption import Adopter, adoptable_keys
from lightning_dynatrain.engine.engine import DIRECT_MIN_BYTES, Allocator, execute_switch
from lightning_dynatrain.engine.errors import (
    EngineInternalError,
    StagingBudgetError,
    StateStoreError,
    SwitchAbortedError,
)
from lightning_dynatrain.engine.memory_plan import switch_peak_bytes
from lightning_dynatrain.engine.recycling import StorageRecycler
from lightning_dynatrain.engine.report import PrimitiveStats, SwitchReport
from lightning_dynatrain.engine.schedule import Step, active_steps, next_pow2, xor_schedule
from lightning_dynatrain.engine.staging import format_bytes, parse_bytes, plan_stages, split_box
from lightning_dynatrain.engine.store import LocalStore, RegionIndex, StoreKey, box_view

__all__ = [
    "Adopter",
    "DIRECT_MIN_BYTES",
    "adoptable_keys",
    "StorageRecycler",
    "switch_peak_bytes",
    "Allocator",
    "BroadcastJob",
    "BroadcastPlan",
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
    "SwitchAbortedError",
    "SwitchReport",
    "active_steps",
    "box_view",
    "execute_switch",
    "format_bytes",
    "measure_link_costs",
    "next_pow2",
    "parse_bytes",
    "plan_broadcasts",
    "plan_stages",
    "split_box",
    "xor_schedule",
]
