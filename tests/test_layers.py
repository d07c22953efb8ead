"""The package's folders import one way: each room imports only the rooms of the layers below it.

Every import of every module is read with ``ast``, function-level imports and imports under
``TYPE_CHECKING`` included (a type-only import still says a module knows the other). A room is a
top-level folder of the package (``elastic/driver`` is a room of its own above the ``elastic``
protocol) or a top-level module. Rooms of one layer do not import each other: the Lightning
strategy and the loop engine, for instance, are two front ends over the same core. A failure names
the file, the line and the import that breaks the order, and the layers it crosses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dynatrain"

#: the layers, bottom first: (what the layer is, its rooms)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("utilities, and every private name of torch, megatron-core and Lightning",
     ("compat", "warning_filters", "gc_pause", "progress_line", "thread_end")),
    ("the Virtual Parameter Space: layouts, boxes, the planner (pure, no torch)", ("vps",)),
    ("the state transition engine: switch programs compiled and walked", ("transition",)),
    ("the elastic protocol: the job's store, sessions, worlds", ("elastic",)),
    ("device kinds and their memory policies", ("devices",)),
    ("the megatron-core adapter", ("megatron",)),
    ("data, checkpoints, pictures", ("data", "checkpoint", "viz")),
    ("the training core: settings, recipe, run, switcher, schedule", ("runtime",)),
    ("the elastic driver: world changes and recoveries", ("elastic/driver",)),
    ("an elastic job's launchers as Lightning and Fabric see them", ("launch_environment",)),
    ("the front ends: the Lightning strategy, the loop engine", ("strategy", "loop")),
    ("the loop libraries' front ends", ("accelerate", "fabric")),
    ("Lightning callbacks", ("callbacks",)),
    ("entry points", ("lightning_cli", "cli", "__init__")),
)

#: rooms that import no Lightning (``lightning``, ``lightning_fabric``, ``lightning_utilities``)
LIGHTNING_FREE = ("vps", "transition", "elastic", "devices", "megatron", "checkpoint", "viz", "runtime",
                  "elastic/driver")
#: rooms that import no megatron-core either
MEGATRON_FREE = ("vps", "transition", "elastic")

LAYER_OF = {room: index for index, (_, rooms) in enumerate(LAYERS) for room in rooms}


def room_of(path: Path) -> str:
    """The room of a package file: its folder (``elastic/driver`` before ``elastic``) or its module."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if len(parts) == 1:
        return parts[0]
    nested = "/".join(parts[:2])
    return nested if nested in LAYER_OF else parts[0]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import in ``path``, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-node.level])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from pkg import module`` names a module too: count the deeper name when it is one
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def room_of_module(dotted: str) -> str | None:
    """The package room a dotted name lands in, or ``None`` outside the package."""
    parts = dotted.split(".")
    if parts[0] != "lightning_dynatrain" or len(parts) < 2:
        return None
    if "/".join(parts[1:3]) in LAYER_OF:
        return "/".join(parts[1:3])
    return parts[1] if parts[1] in LAYER_OF else "__init__"


def broken_imports() -> list[str]:
    """Every import that does not go down the table, as ``file:line imports module (room, layer ->
    room, layer)``."""
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(path)
        if room not in LAYER_OF:
            broken.append(f"{path.relative_to(PACKAGE.parent)}: room {room!r} is in no layer of LAYERS")
            continue
        for line, module in imported_modules(path):
            target = room_of_module(module)
            if target is None or target == room:
                continue
            if LAYER_OF[target] >= LAYER_OF[room]:
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                              f"({room}, layer {LAYER_OF[room]} -> {target}, layer {LAYER_OF[target]}: "
                              f"{LAYERS[LAYER_OF[target]][0]})")
    return broken


def test_every_import_goes_down_the_layers() -> None:
    broken = broken_imports()
    assert not broken, "imports against the layers (tests/test_layers.py LAYERS):\n" + "\n".join(broken)


def test_every_room_of_the_package_has_a_layer() -> None:
    rooms = {room_of(path) for path in PACKAGE.rglob("*.py")}
    assert rooms == set(LAYER_OF), f"rooms without a layer: {sorted(rooms - set(LAYER_OF))}; " \
                                   f"layers naming no room: {sorted(set(LAYER_OF) - rooms)}"


@pytest.mark.parametrize(("rooms", "forbidden"), [(LIGHTNING_FREE, ("lightning", "lightning_fabric",
                                                                    "lightning_utilities")),
                                                  (MEGATRON_FREE, ("megatron",))],
                         ids=["lightning-free", "megatron-free"])
def test_the_core_rooms_import_no_front_end_library(rooms: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    """The training core, the elastic driver and everything under them import no Lightning; the
    elastic protocol, the engine and the VPS no megatron-core either."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted(PACKAGE.rglob("*.py")) if room_of(path) in rooms
             for line, module in imported_modules(path) if module.split(".")[0] in forbidden]
    assert not found, "\n".join(found)


def test_the_check_fails_on_an_import_up_the_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test of the test: a runtime module that imports the strategy is named, with its line."""
    root = tmp_path / "lightning_dynatrain"
    for room in ("runtime", "strategy"):
        (root / room).mkdir(parents=True)
        (root / room / "__init__.py").write_text("")
    (root / "runtime" / "bad.py").write_text("def f():\n    from lightning_dynatrain.strategy import x\n")
    for name in {r for _, rooms in LAYERS for r in rooms} - {"runtime", "strategy"}:
        path = root / (name + ".py" if "/" not in name else name + "/__init__.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", root)
    assert broken_imports() == ["lightning_dynatrain/runtime/bad.py:2 imports lightning_dynatrain.strategy.x "
                                "(runtime, layer 7 -> strategy, layer 10: the front ends: the Lightning strategy, "
                                "the loop engine)"]
