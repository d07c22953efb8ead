"""Private names of torch, megatron-core and Lightning live in one compatibility layer.

Every use of such a name is found by reading the source (``ast``) of the package and of what users
run beside it (``benchmarks/``, ``examples/``, ``scripts/``). They may appear in
``lightning_dynatrain/compat/`` (each module there says the version it was checked on) and in the
CPU adapter ``lightning_dynatrain/devices/host/megatron_patches/``, which patches megatron's private
functions by design, one commented patch each: together, the layer. Anywhere else the test fails,
naming the file, the line and the name.

What a private name (``_x``; a dunder ``__x__`` is none) refers to is worked out from the code, with
no hand-kept list:

- an import of a private name or module of theirs;
- a name bound by an import from torch, megatron, Lightning (``lightning``, ``lightning_fabric``,
  ``lightning_utilities``) or Accelerate, whatever it is (a module, a class, a function, an
  object): any private attribute taken on it, or on an attribute chain or call rooted at it
  (``c10d._world.pg_map``, ``DistributedOptimizer._set_main_param_and_optimizer_states``);
- ``self`` in a class with one of their classes among its ancestors: a private name their classes
  have (their class dicts, and the ``self._x`` their source reads or sets: ``_launcher``,
  ``_lightning_optimizers``), a method overriding one (``def _configure_launcher``), a name the
  layer reaches (below), or one the project does not define;
- any other object (``logger._version``, ``getattr(module, "_trainer")``, ``setattr``, ``hasattr``,
  ``delattr``): a private name that is not the project's own, that the layer reaches, or that one
  of their classes the project derives from has (``LightningModule._trainer``).

The project's OWN private names are those it defines outside the layer: its module-level names,
functions, classes and import aliases, and what its classes define (methods, class attributes,
``self._x`` assignments). The names the LAYER REACHES are the private names the layer takes on
anything but ``self``, imports, or inherits: a name of theirs is theirs everywhere, even where the
project has one of the same spelling (``getattr(module, "_trainer")`` of a ``LightningModule`` beside
the project's own ``self._trainer``; ``self._is_accelerate_prepared = True`` in a subclass of
``torch.nn.Module``), so the project keeps its own names apart from those: only an object of a
class of the project's with no third-party ancestor may have its own attribute of such a name.
Private names of the standard library taken on its modules (``os._exit``) and the documented
``namedtuple`` API (``_replace``, ``_fields``) are not this guard's.
"""

from __future__ import annotations

import ast
import collections
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dynatrain"
#: what users run besides the package: its benchmarks, examples and scripts go through the layer too
#: (the tests may read internals to check them)
USER_CODE = ("benchmarks", "examples", "scripts")
THIRD_PARTY = ("torch", "megatron", "lightning", "lightning_fabric", "lightning_utilities", "accelerate")
#: top-level packages of this repository: a name imported from them is the project's
PROJECT = ("lightning_dynatrain", "tests", *USER_CODE)
#: where the private names may be (paths from the repository root)
LAYER = ("lightning_dynatrain/compat/", "lightning_dynatrain/devices/host/megatron_patches/")
REFLECTION = ("getattr", "setattr", "hasattr", "delattr")


def is_private(name: str) -> bool:
    """``_x`` or ``__x``; not a dunder (``__x__``) nor the throw-away ``_``."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


#: the documented API of a ``namedtuple`` spells its names with a ``_`` to keep them from its fields
NAMEDTUPLE_API = frozenset(name for name in dir(collections.namedtuple("T", "a")) if is_private(name))


@dataclass(frozen=True)
class Reference:
    """A private ``name`` taken on ``receiver`` (an attribute, or the name given to ``getattr`` and
    the like) in ``function`` of ``klass``, or defined in the body of ``klass`` (``receiver`` is
    ``None``), at ``line``."""

    name: str
    receiver: ast.expr | None
    klass: ast.ClassDef | None
    line: int
    function: ast.FunctionDef | ast.AsyncFunctionDef | None = None

    def text(self) -> str:
        owner = ast.unparse(self.receiver) if self.receiver is not None else self.klass.name  # type: ignore[union-attr]
        return f"{owner}.{self.name}"


def _is_self(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain, call or subscript starts from (``dist`` of ``dist.c10d._world``)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _chain(node: ast.expr) -> list[str]:
    """The attributes taken after the root of a plain chain (``["nn", "Module"]`` of ``torch.nn.Module``)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return out[::-1]


class FileScan(ast.NodeVisitor):
    """What one file binds by import, defines, and reaches by a private name."""

    def __init__(self, source: str) -> None:
        self.tree = ast.parse(source)
        #: local name -> (module, name imported from it or ``None``); relative imports are the project's
        self.imports: dict[str, tuple[str, str | None]] = {}
        #: private modules and names of theirs imported (``torch.distributed._shard.sharded_tensor.ShardedTensor``)
        self.private_imports: dict[str, list[int]] = {}
        self.references: list[Reference] = []
        #: private names defined at module level (names, functions, classes, import aliases)
        self.defined: set[str] = set()
        #: private names each class defines: its body's names and methods, what it sets on ``self``
        self.class_defined: dict[ast.ClassDef, set[str]] = {}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self._scopes: list[ast.AST] = [self.tree]
        self.visit(self.tree)

    # ------------------------------------------------------------------ scopes
    def _klass(self) -> ast.ClassDef | None:
        return next((s for s in reversed(self._scopes) if isinstance(s, ast.ClassDef)), None)

    def _define(self, name: str, line: int) -> None:
        """``name`` bound in the current scope: an attribute of the module or of the class it is in
        (a function's locals are no attributes); in a class, a definition to check for an override."""
        if not is_private(name):
            return
        scope = self._scopes[-1]
        if isinstance(scope, ast.ClassDef):
            self.class_defined[scope].add(name)
            self.references.append(Reference(name, None, scope, line))
        elif isinstance(scope, ast.Module):
            self.defined.add(name)

    def _scoped(self, node: ast.AST) -> None:
        self._scopes.append(node)
        self.generic_visit(node)
        self._scopes.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.setdefault(node.name, []).append(node)
        self.class_defined.setdefault(node, set())
        self._define(node.name, node.lineno)
        for decorator in node.decorator_list:
            self.visit(decorator)
        for expr in [*node.bases, *node.keywords]:
            self.visit(expr)
        self._scopes.append(node)
        for statement in node.body:
            self.visit(statement)
        self._scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._define(node.name, node.lineno)
        self._scoped(node)

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = _scoped

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._define(node.id, node.lineno)

    # ------------------------------------------------------------------ imports
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] in THIRD_PARTY and any(is_private(p) for p in parts):
                self.private_imports.setdefault(alias.name, []).append(node.lineno)
            local = alias.asname or parts[0]
            self.imports[local] = (alias.name if alias.asname else parts[0], None)
            self._define(local, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "lightning_dynatrain" if node.level else (node.module or "")
        theirs = module.split(".")[0] in THIRD_PARTY
        private_module = any(is_private(p) for p in module.split("."))
        for alias in node.names:
            if theirs and (private_module or is_private(alias.name)):
                self.private_imports.setdefault(f"{module}.{alias.name}", []).append(node.lineno)
            local = alias.asname or alias.name
            self.imports[local] = (module, alias.name)
            self._define(local, node.lineno)

    # ------------------------------------------------------------------ references
    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_private(node.attr):
            self._reach(node.attr, node.value, node.lineno, store=not isinstance(node.ctx, ast.Load))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if (isinstance(func, ast.Name) and func.id in REFLECTION and len(args) >= 2
                and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) and is_private(args[1].value)):
            self._reach(args[1].value, args[0], node.lineno, store=func.id == "setattr")
        self.generic_visit(node)

    def _reach(self, name: str, receiver: ast.expr, line: int, *, store: bool) -> None:
        klass = self._klass()
        function = next((s for s in reversed(self._scopes) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))),
                        None)
        self.references.append(Reference(name, receiver, klass, line, function))
        if store and klass is not None and _is_self(receiver):
            self.class_defined[klass].add(name)


def _resolve(module: str, name: str | None, chain: list[str]) -> object:
    """The object ``module.name.chain...`` of an installed package (a submodule imported if needed)."""
    found = importlib.import_module(module)
    if name is not None:
        found = getattr(found, name) if hasattr(found, name) else importlib.import_module(f"{module}.{name}")
    for attr in chain:
        found = getattr(found, attr)
    return found


@functools.cache
def inherited_privates(cls: type) -> frozenset[str]:
    """The private names the third-party classes among ``cls``'s ancestors have: in their class
    dicts, and as ``self._x`` / ``cls._x`` in their source (instance attributes they set or read)."""
    names: set[str] = set()
    for ancestor in cls.__mro__:
        if ancestor.__module__.split(".")[0] not in THIRD_PARTY:
            continue
        names |= {name for name in vars(ancestor) if is_private(name)}
        try:
            source = inspect.getsource(ancestor)
        except (OSError, TypeError):  # a class of a C extension: its class dict is all there is
            continue
        names |= {name for name in re.findall(r"\b(?:self|cls)\.(_\w+)", source) if is_private(name)}
    return frozenset(names)


class Project:
    """The facts of the whole repository the check of one file needs, read from its source: its
    classes (to find their third-party ancestors), its own private names, and the private names
    the layer reaches (see the module docstring)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.scans = {path: FileScan(source) for path, source in files.items()}
        self._inherited: dict[ast.ClassDef, frozenset[str]] = {}
        self.classes: dict[str, list[tuple[FileScan, ast.ClassDef]]] = {}
        for scan in self.scans.values():
            for name, nodes in scan.classes.items():
                self.classes.setdefault(name, []).extend((scan, node) for node in nodes)
        outside = [scan for path, scan in self.scans.items() if not path.startswith(LAYER)]
        self.own = set().union(*(self._defined(scan) for scan in outside))
        layer = [scan for path, scan in self.scans.items() if path.startswith(LAYER)]
        self.layer_reaches = set().union(*(self._reached(scan) for scan in layer))
        #: what the classes of theirs that the project's classes derive from have
        self.subclassed = set().union(*(self.inherited(scan, klass) for scan in self.scans.values()
                                        for klass in scan.class_defined if self.has_third_party_ancestor(scan, klass)))

    # ------------------------------------------------------------------ classes
    def _bases(self, scan: FileScan, klass: ast.ClassDef) -> list[tuple]:
        """Each base of ``klass``: a project class (``(scan, node)``), or a third-party one
        (``(module, name, chain)`` to resolve); a base of neither (a builtin, the standard library's) is left out."""
        out: list[tuple] = []
        for base in klass.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            root, chain = _root(base), _chain(base)
            if root in scan.imports:
                module, name = scan.imports[root]
                if module.split(".")[0] in THIRD_PARTY:
                    out.append((module, name, chain))
                elif module.split(".")[0] in PROJECT:
                    out += self.classes.get((chain or [name or root])[-1], [])
            elif root in scan.classes and not chain:
                out += [(scan, node) for node in scan.classes[root] if node is not klass]
        return out

    def third_party_ancestors(self, scan: FileScan, klass: ast.ClassDef, seen: frozenset = frozenset()) -> list[type]:
        """The third-party classes ``klass`` derives from, through the project's own classes too."""
        found: list[type] = []
        for base in self._bases(scan, klass):
            if isinstance(base[0], FileScan):
                if id(base[1]) not in seen:
                    found += self.third_party_ancestors(base[0], base[1], seen | {id(klass)})  # type: ignore[arg-type]
            else:
                module, name, chain = base  # type: ignore[misc]
                try:
                    resolved = _resolve(module, name, chain)
                except (ImportError, AttributeError) as err:
                    raise AssertionError(f"class {klass.name}: cannot resolve its base "
                                         f"{'.'.join([module, *filter(None, [name]), *chain])}: {err}") from err
                if isinstance(resolved, type):
                    found.append(resolved)
        return found

    def has_third_party_ancestor(self, scan: FileScan, klass: ast.ClassDef, seen: frozenset = frozenset()) -> bool:
        """Without importing anything: a base of ``klass``, or of a project class it derives from, is theirs."""
        for base in self._bases(scan, klass):
            if not isinstance(base[0], FileScan):
                return True
            if id(base[1]) not in seen and self.has_third_party_ancestor(base[0], base[1], seen | {id(klass)}):
                return True
        return False

    def inherited(self, scan: FileScan, klass: ast.ClassDef) -> frozenset[str]:
        """The private names the third-party classes ``klass`` derives from have (``inherited_privates``)."""
        if klass not in self._inherited:
            self._inherited[klass] = frozenset().union(
                *(inherited_privates(cls) for cls in self.third_party_ancestors(scan, klass)))
        return self._inherited[klass]

    # ------------------------------------------------------------------ names
    @staticmethod
    def _defined(scan: FileScan) -> set[str]:
        """The private names ``scan`` defines: at module level, and in its classes."""
        return set(scan.defined).union(*scan.class_defined.values())

    def _reached(self, scan: FileScan) -> set[str]:
        """The private names a file of the layer reaches: imported, taken on anything but ``self``,
        and inherited from their classes (taken on ``self``, or overridden)."""
        names = {name for path in scan.private_imports if is_private(name := path.rsplit(".", 1)[-1])}
        for ref in scan.references:
            if ref.receiver is not None and not _is_self(ref.receiver):
                names.add(ref.name)
            elif ref.klass is not None and self.has_third_party_ancestor(scan, ref.klass) \
                    and ref.name in self.inherited(scan, ref.klass):
                names.add(ref.name)
        return names

    # ------------------------------------------------------------------ the check
    def why(self, scan: FileScan, ref: Reference, own: set[str]) -> str | None:
        """Why ``ref`` is a private name of theirs (``None``: it is the project's own, or not this guard's)."""
        name, receiver, klass = ref.name, ref.receiver, ref.klass
        if receiver is None:  # defined in a class body: an override of theirs?
            assert klass is not None
            return "overrides theirs" if name in self.inherited(scan, klass) else None
        binding = scan.imports.get(_root(receiver) or "")
        if binding is not None and not _is_self(receiver):
            top = binding[0].split(".")[0]
            if top in THIRD_PARTY:
                return "taken on an import of theirs"
            if top not in PROJECT:
                return None  # the standard library's, another library's: not this guard's
        if _is_self(receiver) and klass is not None:
            if not self.has_third_party_ancestor(scan, klass):
                return None if name in own else "the project does not define it"
            if name in self.inherited(scan, klass):
                return "their class has it"
            if name in self.layer_reaches:
                return "the layer reaches it"
            return None if name in own else "the project does not define it"
        if name in NAMEDTUPLE_API:
            return None
        if name in self.layer_reaches:
            return "the layer reaches it"
        if name in self.subclassed:
            return "a class of theirs the project derives from has it"
        return None if name in own else "the project does not define it"

    def uses(self, scan: FileScan) -> dict[str, list[str]]:
        """Each private name of theirs ``scan`` uses, as ``receiver._name`` (or the import) -> where and why."""
        own = self.own | self._defined(scan)
        found: dict[str, list[str]] = {}
        for path, lines in scan.private_imports.items():
            found.setdefault(path, []).extend(f"line {line}: a private import" for line in lines)
        for ref in scan.references:
            if (reason := self.why(scan, ref, own)) is not None:
                found.setdefault(ref.text(), []).append(f"line {ref.line}: {reason}")
        return found


def _sources() -> dict[str, str]:
    files = sorted(PACKAGE.rglob("*.py")) + [p for folder in USER_CODE for p in sorted((ROOT / folder).rglob("*.py"))]
    return {str(path.relative_to(ROOT)): path.read_text() for path in files}


@functools.cache
def project() -> Project:
    return Project(_sources())


def private_uses(source: str) -> dict[str, list[str]]:
    """The private names of theirs ``source`` uses, were it a file of the project outside the layer."""
    return project().uses(FileScan(source))


def test_private_names_of_torch_megatron_and_lightning_stay_in_the_compatibility_layer() -> None:
    repo = project()
    outside = {path: uses for path, scan in repo.scans.items()
               if not path.startswith(LAYER) and (uses := repo.uses(scan))}
    assert outside == {}, f"private names of theirs used outside lightning_dynatrain/compat/: {outside}"
    inventory = sorted(repo.layer_reaches)
    print(f"the layer reaches {len(inventory)} private names: {inventory}")
    # the scan sees what the layer holds: an import, a module global, an object's, a mark, an override
    assert {"_update_default_pg", "_global_process_group_list", "_get_model_param_range_map", "_results",
            "_is_accelerate_prepared", "_trainer", "_configure_launcher"} <= set(inventory)


def test_the_scan_finds_each_kind_of_use() -> None:
    source = '''
import os
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.strategies import ParallelStrategy
from megatron.core import parallel_state
groups = dist.distributed_c10d._world.pg_map
parallel_state._global_process_group_list = None
connector = trainer._checkpoint_connector

class Strategy(ParallelStrategy):
    def _configure_launcher(self):
        self._launcher = None
        self._mine = other._mine
'''
    assert set(private_uses(source)) == {
        "torch.distributed._shard.sharded_tensor.ShardedTensor",
        "lightning.fabric.utilities.distributed._init_dist_connection",
        "dist.distributed_c10d._world", "parallel_state._global_process_group_list", "trainer._checkpoint_connector",
        "Strategy._configure_launcher", "self._launcher"}


#: the escapes a review found, as they would appear outside compat/, and what the scan must report
ESCAPES = {
    "a private method taken on an imported class": (
        "from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer\n"
        "DistributedOptimizer._set_main_param_and_optimizer_states = patched\n",
        "DistributedOptimizer._set_main_param_and_optimizer_states"),
    "a Lightning logger's version": ("if logger._version is None:\n    pass\n", "logger._version"),
    "a Lightning logger's writer": ("logger._experiment = writer\n", "logger._experiment"),
    "Accelerate's mark on any object": ("x._is_accelerate_prepared = True\n", "x._is_accelerate_prepared"),
    "a LightningModule's trainer, by getattr": ('trainer = getattr(module, "_trainer")\n', "module._trainer"),
    "the Trainer's results": ("results = trainer._results\n", "trainer._results"),
    "a training loop's method looked up with a default": (
        'broadcast = getattr(trainer, "_broadcast_sigterm_tensor", None)\n', "trainer._broadcast_sigterm_tensor"),
    "an attribute of a Lightning class, through self": (
        "from lightning.pytorch.strategies import Strategy\n"
        "class S(Strategy):\n    def first(self):\n        return self._lightning_optimizers[0]\n",
        "self._lightning_optimizers"),
    "a method of LightningCLI spelled as one of the project's": (
        "from lightning.pytorch.cli import LightningCLI\n"
        "class C(LightningCLI):\n    def f(self):\n        return self._get(self.config, 'trainer')\n", "self._get"),
}


@pytest.mark.parametrize("source, expected", ESCAPES.values(), ids=list(ESCAPES))
def test_the_scan_reports_each_escape_the_review_found(source: str, expected: str) -> None:
    assert expected in private_uses(source), f"not reported: {expected} in\n{source}"


def test_the_scan_leaves_the_projects_own_names_alone() -> None:
    source = '''
import os
from lightning_dynatrain.strategy.checkpoint_hooks import Checkpointing

class Hooks:
    def __init__(self, trainer):
        self._trainer = trainer  # a name the layer reaches on Lightning's objects: own on a class of ours
        self._mine = trainer

    def run(self, other: "Hooks"):
        return self._trainer(), other._mine, point._replace(x=1), point._fields, os._exit
'''
    assert private_uses(source) == {}
