"""Every private name ``lightning_dynatrain/compat/`` holds is still where it reads it: an upgrade of
torch, megatron-core, Lightning or Accelerate that moves one fails here, naming it, the installed
version and the versions the module was checked on, before any run reaches it.

The names are read from compat's own source with the scan of ``tests/test_private_names.py``, so
none can be left out: each private import, each private attribute and each name given to
``getattr``/``setattr``/``hasattr``, each override of theirs in a class of the layer, and each
public name taken on an object of a private class of theirs (``connector.restore_callbacks()`` of a
``_CheckpointConnector``). Each is checked on what its receiver is:

- an import of theirs, and the attribute chain from it (``c10d._world.pg_map``);
- a parameter or local variable annotated with a class of theirs (``trainer: Trainer``; ``A | B``:
  on each), or made by calling one (``pg = c10d.ProcessGroup(...)``); ``self`` in a class of the
  layer that derives from theirs. On a class, a name is there when the class or a base has it, or
  the source of a base reads or sets it on ``self`` (an instance attribute);
- annotated ``Any`` (a mark set on any object): by name, in the source of the packages the module
  imports from. A receiver of no known kind fails, asking for its annotation.

A private name spelled as a string (the names of megatron's ``parallel_state`` globals, for
``getattr(parallel_state, name)``) must be an attribute of a module of theirs the compat module
imports. A private name in a function that first looks up the public name replacing it
(``getattr(dist, "set_timeout", None)``) is checked only where the installed version lacks the
public one. A receiver made from a public name this build lacks (``ProcessGroupNCCL`` in a CPU
build of torch) is skipped, saying so. And a private name looked up with a default
(``getattr(x, "_name", None)``, ``hasattr``) must raise when it is missing, naming it, or say on its
line why skipping it is safe.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import importlib.util
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.test_private_names import (
    REFLECTION,
    THIRD_PARTY,
    FileScan,
    Reference,
    _is_self,
    inherited_privates,
    is_private,
    project,
)

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "lightning_dynatrain" / "compat"
#: the distribution that installs each top-level package (for the installed version in a failure)
DISTRIBUTION = {"torch": "torch", "megatron": "megatron-core", "lightning": "lightning",
                "lightning_fabric": "lightning", "lightning_utilities": "lightning-utilities",
                "accelerate": "accelerate"}
IDENTIFIER = re.compile(r"_[A-Za-z_]\w*")


@dataclass(frozen=True)
class Case:
    """One private name compat reaches: ``text`` at ``line`` of ``file`` (``compat/x.py``); ``ref``:
    its reference (``None`` for an import or a string), ``import_path``: ``module.name`` of an import."""

    file: str
    line: int
    text: str
    ref: Reference | None = None
    import_path: str | None = None
    string: str | None = None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line} {self.text}"


@cache
def scans() -> dict[str, FileScan]:
    return {f"compat/{path.name}": FileScan(path.read_text()) for path in sorted(COMPAT.glob("*.py"))}


def _annotated_private_class(ref: Reference) -> bool:
    """``ref``'s receiver is a name its function annotates with a private class (``_CheckpointConnector``)."""
    if ref.function is None or not isinstance(ref.receiver, ast.Name):
        return False
    for annotation in _annotations(ref.function).get(ref.receiver.id, []):
        names = [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)]
        names += [n.value for n in ast.walk(annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if any(is_private(name.rsplit(".", 1)[-1]) for name in names):
            return True
    return False


def _public_on_private(path: str, scan: FileScan) -> list[Case]:
    """Public attributes compat takes on a private object of theirs (``c10d._world.pg_map``), or on
    one it annotates with a private class of theirs (``connector: _CheckpointConnector``)."""
    out = []
    for function in [n for n in ast.walk(scan.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(function):
            if not isinstance(node, ast.Attribute) or is_private(node.attr):
                continue
            ref = Reference(node.attr, node.value, None, node.lineno, function)
            on_private = isinstance(node.value, ast.Attribute) and is_private(node.value.attr)
            if on_private or (isinstance(node.value, ast.Name) and _annotated_private_class(ref)):
                out.append(Case(path, node.lineno, ref.text(), ref=ref))
    return out


def _strings(scan: FileScan) -> list[tuple[int, str]]:
    """Private identifiers spelled as strings, other than the names given to ``getattr`` and the like."""
    given = {id(node.args[1]) for node in ast.walk(scan.tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in REFLECTION and len(node.args) >= 2}
    return [(node.lineno, node.value) for node in ast.walk(scan.tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in given
            and IDENTIFIER.fullmatch(node.value) and is_private(node.value)]


def cases() -> list[Case]:
    """Every private name compat reaches (see the module docstring)."""
    out = []
    repo = project()
    for path, scan in scans().items():
        for import_path, lines in scan.private_imports.items():
            out.append(Case(path, lines[0], import_path, import_path=import_path))
        for ref in scan.references:
            if ref.receiver is None or _is_self(ref.receiver):  # an override, a name on self: in a class of theirs
                if ref.klass is None or not repo.has_third_party_ancestor(scan, ref.klass):
                    continue
            out.append(Case(path, ref.line, ref.text(), ref=ref))
        out += _public_on_private(path, scan)
        out += [Case(path, line, f"{string!r}", string=string) for line, string in _strings(scan)]
    return sorted(set(out), key=lambda c: (c.file, c.line, c.text))



# ------------------------------------------------------------------------------ what a receiver is
class Absent(Exception):
    """A public name of theirs that a receiver is made from is not in this build."""


class Unknown(Exception):
    """What a receiver is cannot be told from compat's source."""


ANY = "Any"


@dataclass(frozen=True)
class Seen:
    """What a receiver is: ``obj`` itself (a module, a class, a function...), or an instance of the
    class ``obj`` (``instance``)."""

    obj: object
    instance: bool

    def has(self, name: str) -> bool:
        if hasattr(self.obj, name):
            return True
        return isinstance(self.obj, type) and name in inherited_privates(self.obj)


@cache
def _annotations_and_values(function: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[dict, dict]:
    annotations: dict[str, list[ast.expr]] = {}
    values: dict[str, list[ast.expr]] = {}
    arguments = function.args
    for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]:
        if arg is not None and arg.annotation is not None:
            annotations.setdefault(arg.arg, []).append(arg.annotation)
    for node in ast.walk(function):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotations.setdefault(node.target.id, []).append(node.annotation)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
    return annotations, values


def _annotations(function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list[ast.expr]]:
    return _annotations_and_values(function)[0]


class Receivers:
    """What the receivers of one compat module's names are, from its imports, its annotations and
    its local variables."""

    def __init__(self, scan: FileScan) -> None:
        self.scan = scan

    def imported(self, name: str, chain: list[str]) -> object:
        module, attr = self.scan.imports[name]
        found: object = importlib.import_module(module)
        path = [module]
        for part in ([attr] if attr is not None else []) + chain:
            path.append(part)
            if hasattr(found, part):
                found = getattr(found, part)
            elif inspect.ismodule(found) and importlib.util.find_spec(f"{found.__name__}.{part}") is not None:
                found = importlib.import_module(f"{found.__name__}.{part}")
            elif is_private(part):
                raise Unknown(f"{'.'.join(path)} is gone (its own check says so)")
            else:
                raise Absent(f"this build has no {'.'.join(path)}")
        return found

    def of(self, expr: ast.expr, ref: Reference, depth: int = 0) -> list[Seen] | str:
        """What ``expr`` (in ``ref``'s function and class) is: each thing it may be, or ``ANY``."""
        if depth > 8:
            raise Unknown(f"{ast.unparse(expr)}: too deep")
        if isinstance(expr, ast.Name):
            return self._name(expr.id, ref, depth)
        if isinstance(expr, ast.Attribute):
            base = self.of(expr.value, ref, depth + 1)
            if base == ANY:
                return ANY
            found = []
            for seen in base:
                if seen.instance:
                    raise Unknown(f"{ast.unparse(expr)}: an attribute of an instance (annotate it)")
                if not hasattr(seen.obj, expr.attr):
                    if is_private(expr.attr):
                        raise Unknown(f"{ast.unparse(expr)} is gone (its own check says so)")
                    raise Absent(f"this build has no {ast.unparse(expr)}")
                found.append(Seen(getattr(seen.obj, expr.attr), instance=False))
            return found
        if isinstance(expr, ast.Call):
            base = self.of(expr.func, ref, depth + 1)
            if base != ANY and all(not seen.instance and isinstance(seen.obj, type) for seen in base):
                return [Seen(seen.obj, instance=True) for seen in base]
        raise Unknown(f"{ast.unparse(expr)}: no annotation, import or constructor says what it is")

    def _name(self, name: str, ref: Reference, depth: int) -> list[Seen] | str:
        if name in ("self", "cls") and ref.klass is not None:
            return [Seen(cls, instance=True) for cls in project().third_party_ancestors(self.scan, ref.klass)]
        if ref.function is not None:
            annotations, values = _annotations_and_values(ref.function)
            if name in annotations:
                return self._union([lambda a=a: self.annotation(a, ref, depth + 1) for a in annotations[name]])
            if name in values:
                return self._union([lambda v=v: self.of(v, ref, depth + 1) for v in values[name]])
        if name in self.scan.imports:
            return [Seen(self.imported(name, []), instance=False)]
        raise Unknown(f"{name}: no annotation, import or constructor says what it is")

    @staticmethod
    def _union(parts: list[Callable[[], list[Seen] | str]]) -> list[Seen] | str:
        """What each of ``parts`` may be, those this build lacks left out (all of them lacking: ``Absent``)."""
        found: list[list[Seen] | str] = []
        absent = []
        for part in parts:
            try:
                found.append(part())
            except Absent as why:
                absent.append(str(why))
        if not found:
            raise Absent("; ".join(absent))
        return ANY if ANY in found else [seen for one in found for seen in one]  # type: ignore[union-attr]

    def annotation(self, expr: ast.expr, ref: Reference, depth: int) -> list[Seen] | str:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return self.annotation(ast.parse(expr.value, mode="eval").body, ref, depth)
        if isinstance(expr, ast.Constant) and expr.value is None:
            return []
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self._union([lambda: self.annotation(expr.left, ref, depth),
                                lambda: self.annotation(expr.right, ref, depth)])
        if (expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)) == "Any":
            return ANY
        if isinstance(expr, (ast.Name, ast.Attribute)):
            root = expr
            chain = []
            while isinstance(root, ast.Attribute):
                chain.insert(0, root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in self.scan.imports:
                found = self.imported(root.id, chain)
                if isinstance(found, type):
                    return [Seen(found, instance=True)]
        raise Unknown(f"annotation {ast.unparse(expr)}: not a class of theirs")


# ------------------------------------------------------------------------------ the checks
def _checked_on(path: str) -> str:
    docstring = ast.get_docstring(scans()[path].tree) or ""
    found = re.search(r"checked\s+on\s+(.*?)\.(?:\s|$)", docstring, re.S)
    return " ".join(found.group(1).split()) if found else "(the module says no version)"


def _installed(scan: FileScan) -> str:
    tops = sorted({module.split(".")[0] for module, _ in scan.imports.values()} & set(THIRD_PARTY))
    return ", ".join(f"{DISTRIBUTION[top]} {md.version(DISTRIBUTION[top])}" for top in tops)


def _fail(case: Case, what: str) -> None:
    scan = scans()[case.file]
    pytest.fail(f"{_installed(scan)}: {what}; lightning_dynatrain/{case.file} line {case.line} reads it "
                f"(checked on {_checked_on(case.file)}): adapt the compatibility layer to this version")


def _named(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


def _named_in_sources(scan: FileScan, name: str) -> bool:
    """``name`` is spelled in the source of a package of theirs the module imports from."""
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    for top in sorted({module.split(".")[0] for module, _ in scan.imports.values()} & set(THIRD_PARTY)):
        spec = importlib.util.find_spec(top)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            if any(pattern.search(p.read_text(errors="replace")) for p in Path(folder).rglob("*.py")):
                return True
    return False


def _replaced_by_public(case: Case, receivers: Receivers) -> str | None:
    """The public name that replaces ``case``'s private one in its function, when installed."""
    function = case.ref.function if case.ref is not None else None
    if function is None:
        return None
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and not is_private(node.args[1].value)):
            try:
                seen = receivers.of(node.args[0], case.ref)  # type: ignore[arg-type]
            except (Unknown, Absent):
                continue
            if seen != ANY and seen and all(s.has(node.args[1].value) for s in seen):  # type: ignore[union-attr]
                return f"{ast.unparse(node.args[0])}.{node.args[1].value}"
    return None


CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_private_name_is_where_the_compatibility_layer_reads_it(case: Case) -> None:
    scan = scans()[case.file]
    receivers = Receivers(scan)
    if case.import_path is not None:
        module, name = case.import_path.rsplit(".", 1)
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError as err:
            _fail(case, f"no module {module} ({err})")
        if not found:
            _fail(case, f"{module} has no {name}")
        return
    if case.string is not None:
        modules = [obj for local in scan.imports if inspect.ismodule(obj := receivers.imported(local, []))
                   and obj.__name__.split(".")[0] in THIRD_PARTY]
        if not any(hasattr(module, case.string) for module in modules):
            _fail(case, f"none of {[m.__name__ for m in modules]} has {case.string}")
        return
    ref = case.ref
    assert ref is not None
    if (public := _replaced_by_public(case, receivers)) is not None:
        pytest.skip(f"the installed {public} replaces {ref.name} here")
    if ref.receiver is None:  # an override in a class of the layer
        ancestors = project().third_party_ancestors(scan, ref.klass)  # type: ignore[arg-type]
        if not any(Seen(cls, instance=True).has(ref.name) for cls in ancestors):
            _fail(case, f"none of {[c.__qualname__ for c in ancestors]} has {ref.name} (the override is never called)")
        return
    try:
        seen = receivers.of(ref.receiver, ref)
    except Absent as why:
        pytest.skip(f"{why}: {ref.text()} is checked on a build that has it")
    except Unknown as why:
        pytest.fail(f"lightning_dynatrain/{case.file} line {case.line}: cannot tell what {ast.unparse(ref.receiver)} "
                    f"is to check {ref.name} on it ({why}). HINT: annotate it with the class of theirs it is "
                    "(Any: any object, checked by name only)")
    if seen == ANY:
        if not _named_in_sources(scan, ref.name):
            _fail(case, f"{ref.name} is nowhere in the source")
        return
    assert seen, f"{ref.text()}: its receiver is nothing"
    missing = [s.obj for s in seen if not s.has(ref.name)]  # type: ignore[union-attr]
    if missing:
        _fail(case, f"{', '.join(_named(m) for m in missing)} has no {ref.name}")


def test_the_cases_cover_what_the_review_found_missing() -> None:
    """The names a hand-kept list missed are read from compat's source now."""
    texts = {case.text for case in CASES}
    assert {"epoch_loop._broadcast_sigterm_tensor", "trainer._results", "options._timeout",
            "'_TENSOR_MODEL_PARALLEL_GROUP'", "'_EMBEDDING_GROUP'", "'_POSITION_EMBEDDING_GROUP'",
            "'_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE'"} <= texts
    group_globals = {text for text in texts if text.startswith("'_") and "_GROUP" in text}
    assert len(group_globals) == 19, sorted(group_globals)  # 17 read or set per layout, 2 more cleared at teardown


def _default_lookups() -> list[tuple[str, int, str, ast.AST]]:
    """``(file, line, name, function)`` of each private name compat looks up with a default or probes."""
    out = []
    for path, scan in scans().items():
        for function in [n for n in ast.walk(scan.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and ((node.func.id == "getattr" and len(node.args) == 3) or node.func.id == "hasattr")
                        and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                        and is_private(node.args[1].value)):
                    out.append((path, node.lineno, node.args[1].value, function))
    return out


def test_a_private_name_looked_up_with_a_default_fails_loudly_or_says_why_skipping_is_safe() -> None:
    lookups = _default_lookups()
    assert any(name == "_broadcast_sigterm_tensor" for _, _, name, _ in lookups)  # the scan sees them
    silent = []
    for path, line, name, function in lookups:
        lines = (COMPAT / path.split("/", 1)[1]).read_text().splitlines()
        said = any("safe" in text.split("#", 1)[1] for text in lines[line - 2:line] if "#" in text)
        raised = any(isinstance(node, ast.Raise) and name in ast.unparse(node) for node in ast.walk(function))
        if not (said or raised):
            silent.append(f"lightning_dynatrain/{path} line {line}: {name}")
    assert not silent, (f"private names looked up with a default, skipped in silence when missing: {silent}. HINT: "
                        "raise InternalsChangedError.missing(...) when it is missing, or say on its line why "
                        "skipping it is safe (a comment with 'safe')")


def test_a_missing_broadcast_of_the_training_loop_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recovery's replay of a step runs Lightning's per-step collectives: without them a survivor
    would be one collective behind the others, so a Lightning without them is an error, not a skip."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lightning_dynatrain.compat import InternalsChangedError
    from lightning_dynatrain.compat.lightning_internals import step_start_collectives

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    epoch_loop = SimpleNamespace()
    trainer = SimpleNamespace(world_size=2, fit_loop=SimpleNamespace(epoch_loop=epoch_loop))
    with pytest.raises(InternalsChangedError) as error:
        step_start_collectives(trainer)  # type: ignore[arg-type]
    installed = md.version("lightning")
    assert f"lightning {installed} has no _TrainingEpochLoop._broadcast_sigterm_tensor" in str(error.value)
    assert "checked on lightning 2.6.6" in str(error.value) and "HINT" in str(error.value)
    ran = []
    epoch_loop._broadcast_sigterm_tensor = lambda: ran.append(True)
    step_start_collectives(trainer)  # type: ignore[arg-type]
    assert ran == [True]
