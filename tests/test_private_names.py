"""Private names of torch, megatron-core and Lightning live in one compatibility layer.

Every use of such a name is found by reading the source (``ast``) of the package and of what users
run beside it (``benchmarks/``, ``examples/``, ``scripts/``): an import of a private
name or module of theirs, an attribute starting with ``_`` taken on one of their modules (``c10d._world``,
``parallel_state._global_process_group_list``), and their objects' private attributes the package is
known to reach (``trainer._checkpoint_connector``, ``group._get_backend_name``). They may appear in
``lightning_dynatrain/compat/`` (each module there says the version it was checked on) and in the
CPU adapter ``lightning_dynatrain/devices/host/megatron_patches/``, which patches megatron's private functions
by design, one commented patch each. Anywhere else the test fails, naming the file and the name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dynatrain"
#: what users run besides the package: its benchmarks, examples and scripts go through the layer too
#: (the tests may read internals to check them)
USER_CODE = ("benchmarks", "examples", "scripts")
THIRD_PARTY = ("torch", "megatron", "lightning", "lightning_fabric", "lightning_utilities", "accelerate")
ALLOWED = ("compat", "devices/host/megatron_patches")
#: private attributes of their *objects* (not modules) the package takes: a new one must be added
#: here when it is moved into the compatibility layer
OBJECT_PRIVATES = {
    "_accelerator_connector", "_checkpoint_connector", "_signal_connector", "_loaded_checkpoint", "_launcher_config",
    "_get_backend_name", "_set_default_backend", "_register_backend", "_set_group_name", "_set_group_desc",
    "_set_sequence_number_for_group", "_get_model_param_range_map", "_base", "_create_internal",
    "_init_from_local_shards_and_global_metadata",
}


def _third_party_modules(tree: ast.Module) -> set[str]:
    """Local names bound to a third-party module (``import torch.distributed as dist``, ``from megatron.core
    import parallel_state``, ``from lightning.pytorch.trainer import call``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in THIRD_PARTY:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            for alias in node.names:
                if alias.name[:1].islower() and "." not in alias.name:  # modules are lower-case names
                    names.add(alias.asname or alias.name)
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(source: str) -> set[str]:
    """The third-party private names ``source`` uses (see the module docstring)."""
    tree = ast.parse(source)
    modules = _third_party_modules(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if private_module or (alias.name.startswith("_") and not alias.name.startswith("__")):
                    found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in THIRD_PARTY and any(p.startswith("_") for p in parts):
                    found.add(alias.name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            on_module = _root(node.value) in modules
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if on_module or (node.attr in OBJECT_PRIVATES and not own):
                found.add(node.attr if not on_module else f"{_root(node.value)}...{node.attr}")
    return found


def _uses(folder: Path) -> dict[str, set[str]]:
    return {str(path.relative_to(folder)): uses for path in sorted(folder.rglob("*.py"))
            if (uses := private_uses(path.read_text()))}


def test_private_names_of_torch_megatron_and_lightning_stay_in_the_compatibility_layer() -> None:
    uses = _uses(PACKAGE)
    outside = {f: sorted(u) for f, u in uses.items() if not f.startswith(ALLOWED)}
    for folder in USER_CODE:
        outside |= {f"{folder}/{f}": sorted(u) for f, u in _uses(ROOT / folder).items()}
    assert outside == {}, f"private names used outside lightning_dynatrain/compat/: {outside}"
    inventory = sorted({name for names in uses.values() for name in names})
    print(f"{len(inventory)} private names, in {sorted(uses)}: {inventory}")
    assert {"c10d..._update_default_pg", "parallel_state..._global_process_group_list",
            "_get_model_param_range_map"} <= set(inventory)  # the scan sees what the layer holds


def test_the_scan_finds_each_kind_of_use() -> None:
    source = '''
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from lightning.fabric.utilities.distributed import _init_dist_connection
from megatron.core import parallel_state
groups = dist.distributed_c10d._world.pg_map
parallel_state._global_process_group_list = None
connector = trainer._checkpoint_connector
self._mine = other._mine
'''
    assert private_uses(source) == {
        "torch.distributed._shard.sharded_tensor.ShardedTensor",
        "lightning.fabric.utilities.distributed._init_dist_connection",
        "dist..._world", "parallel_state..._global_process_group_list", "_checkpoint_connector"}
