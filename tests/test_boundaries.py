"""No module reaches into another module's underscore attributes (STYLE.md rule 12), no
package's modules import each other in a cycle, no Python file (tests included) is over 600
lines, and only the scheduler writes a request's progress (issue 40; see the three sections at
the end).

Walks the AST of every source file under the project's folders (not the tests) and fails on:

* ``expr._name`` (one leading underscore, not a dunder) where ``expr`` is not ``self``, ``cls``
  or ``super()`` and ``_name`` is not defined in the same file -- as ``self._name``/``cls._name``,
  a class attribute, a module-level name, a ``def``/``class`` or an import there. A name the file
  defines is its own object's (``other._x`` on another instance of the same class), so a module
  may read its own privates wherever they live; ``getattr``/``setattr``/``hasattr``/``delattr``
  with such a name spelled out count the same;
* ``from a.b import _name`` and ``from a._b import name``: a private name or module imported
  from elsewhere.

A component that needs another's internals gets a public method for it instead. The few
deliberate exceptions -- private APIs of Ray, torch and the standard library that we rely on
knowingly, each with no public equivalent -- are listed in `ALLOWED` with the reason; an entry
that no longer matches anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Not source: the tests themselves (they may open up what they test), and what is not ours.
NOT_SOURCE = {"tests", "build", "dist"}

# (file relative to the repository root, the flagged expression as `ast.unparse` writes it): why.
ALLOWED: dict[tuple[str, str], str] = {
    ("infra/local_ray.py", "from ray._private import ray_constants"):
        "Ray has no public switch for ENABLE_RAY_CLUSTER, which keeps a local Ray on loopback; guarded by ImportError",
    ("infra/cli_admin.py", "argparse._SubParsersAction"):
        "a type annotation: the standard library's only name for what add_subparsers returns",
    ("infra/cli_serve.py", "argparse._SubParsersAction"):
        "a type annotation: the standard library's only name for what add_subparsers returns",
    ("infra/cli_join.py", "argparse._SubParsersAction"):
        "a type annotation: the standard library's only name for what add_subparsers returns",
    ("kernels/cpu_linear.py", "torch.ops.mkldnn._reorder_linear_weight"):
        "oneDNN's weight pre-packing exists only as a private torch op; probed with hasattr, falls back when absent",
    ("kernels/cpu_linear.py", "torch.ops.mkldnn._linear_pointwise"):
        "oneDNN's pre-packed linear exists only as a private torch op; probed with hasattr, falls back when absent",
    ("kernels/cpu_dense_attention.py", "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"):
        "the only CPU attention that returns the log-sum-exp a cascade merge needs; probed, falls back when absent",
    ("kernels/cpu_dense_attention.py", "hasattr(torch.ops.aten, '_scaled_dot_product_flash_attention_for_cpu')"):
        "the probe for the private op above: without it every prefill sequence is attended on its own",
    ("kernels/cpu_linear.py", "hasattr(torch.ops.mkldnn, '_reorder_linear_weight')"):
        "the probe for the private op above: without it the fp32 CPU path falls back to plain linear layers",
    ("kernels/cpu_linear.py", "hasattr(torch.ops.mkldnn, '_linear_pointwise')"):
        "the probe for the private op above: without it the fp32 CPU path falls back to plain linear layers",
    ("kernels/cpu_linear.py", "getattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', None)"):
        "oneDNN's own bfloat16-support check is a private torch op (torch.backends.mkldnn has none); "
        "probed, and bfloat16 layers stay plain when it is absent",
    ("loader/peer_link.py", "options._timeout"):
        "a ProcessGroupNCCL built directly takes its timeout only through Options._timeout (torch has no public field)",
}


def _source_folders() -> list[str]:
    """Every top-level folder of the repository holding Python source (a new one is walked too)."""
    return sorted(p.name for p in ROOT.iterdir()
                  if p.is_dir() and p.name not in NOT_SOURCE and not p.name.startswith(".")
                  and not p.name.endswith(".egg-info") and any(p.rglob("*.py")))


def _source_files() -> list[Path]:
    return sorted(p for folder in _source_folders() for p in (ROOT / folder).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.Module) -> set[str]:
    """The underscore names this file defines: on self/cls, in a class body, at module level,
    as a def or class, or as an import."""
    names: set[str] = set()

    def add_target(target: ast.expr, *, bare: bool) -> None:
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id in ("self", "cls"):
            names.add(target.attr)
        elif bare and isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                add_target(element, bare=bare)

    def visit(node: ast.AST, *, bare: bool) -> None:
        """``bare``: a plain ``_name = ...`` here defines a name others can reach (module level,
        class body), unlike a local variable inside a function."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in child.names)
            elif isinstance(child, ast.Assign):
                for target in child.targets:
                    add_target(target, bare=bare)
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                add_target(child.target, bare=bare)
            visit(child, bare=isinstance(child, ast.ClassDef))

    visit(tree, bare=True)
    return {name for name in names if _is_private(name)}


_ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _named_attribute(node: ast.Call) -> tuple[ast.expr, str] | None:
    """(object, name) of ``getattr(obj, "name", ...)`` and its siblings with the name spelled out."""
    if isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return node.args[0], node.args[1].value
    return None


def _is_own_object(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _violations(path: Path, root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file relative to `root`, line, expression) for each reach into another module's privates in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = _own_names(tree)
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own \
                and not _is_own_object(node.value):
            found.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and (named := _named_attribute(node)) is not None:
            obj, name = named
            if _is_private(name) and name not in own and not _is_own_object(obj):
                found.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.module != "__future__":
            private_module = any(_is_private(part) for part in node.module.split("."))
            for alias in node.names:
                if private_module or _is_private(alias.name):
                    found.append((rel, node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_is_private(part) for part in alias.name.split(".")):
                    found.append((rel, node.lineno, f"import {alias.name}"))
    return sorted(found)


def test_the_walk_covers_the_source():
    folders = set(_source_folders())
    assert {"bench", "controller", "infra", "kernels", "loader", "migration", "storage", "worker"} <= folders
    assert not folders & {"tests", ".venv"}


@pytest.mark.parametrize("source, expected", [
    ("engine._tracked", [(1, "engine._tracked")]),
    ("self._x\ncls._y\nsuper()._z\nobj.__dict__\nobj.public", []),
    ("class A:\n    def __init__(self):\n        self._x = 1\n"
     "    def same(self, other):\n        return other._x\n", []),
    ("class A:\n    _limit = 3\nA._limit\nB._other", [(4, "B._other")]),
    ("def f():\n    _local = 1\n    return obj._local", [(3, "obj._local")]),
    ("from worker.transfer.engine_migration import _pause, freeze_request",
     [(1, "from worker.transfer.engine_migration import _pause")]),
    ("from ray._private import services", [(1, "from ray._private import services")]),
    ("import ray._private.services", [(1, "import ray._private.services")]),
    ("import os\nos._exit(1)", [(2, "os._exit")]),
    ("from worker.engine.engine import _Tracked\nx._Tracked", [(1, "from worker.engine.engine import _Tracked")]),
    ("getattr(engine, '_zigzag', None)\nsetattr(self, '_x', 1)\nhasattr(obj, 'public')",
     [(1, "getattr(engine, '_zigzag', None)")]),
])
def test_the_check_flags_exactly_foreign_privates(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert _violations(path, tmp_path) == [("m.py", line, expr) for line, expr in expected]


def test_no_module_reads_another_modules_private_attributes():
    found = [v for path in _source_files() for v in _violations(path)]
    unexplained = [f"{file}:{line}: {expr}" for file, line, expr in found if (file, expr) not in ALLOWED]
    assert unexplained == [], (
        "these reach into another module's underscore attributes; add a public method to the owner "
        "(or, for a deliberate exception, an entry with its reason in ALLOWED):\n" + "\n".join(unexplained)
    )


def test_every_exception_is_still_needed():
    found = {(file, expr) for path in _source_files() for file, _, expr in _violations(path)}
    stale = sorted(set(ALLOWED) - found)
    assert stale == [], f"these ALLOWED entries no longer match anything; remove them: {stale}"


# --- no import cycle inside a package ----------------------------------------------------------
#
# Every import statement counts, wherever it is: at module level, inside a function (a cycle
# hidden behind a function-level import is still a cycle: the two modules cannot be read or
# loaded apart) and under ``if TYPE_CHECKING`` (a cycle in the types is one in the design). Two
# modules that need each other get a third that both import (an interface, a record, a factory).


def _module_names(root: Path, files: list[Path]) -> dict[str, Path]:
    names = {}
    for path in files:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported_modules(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `path` (module `module`) imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            if base in modules:
                found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    found.discard(module)
    return found


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The import cycles among `modules` inside each top-level package (Tarjan's strongly connected
    components of more than one module), each sorted, in order."""
    graph = {m: {d for d in _imported_modules(m, p, modules) if d.split(".")[0] == m.split(".")[0]}
             for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


@pytest.mark.parametrize("files, expected", [
    ({"p/__init__.py": "", "p/a.py": "from p.b import B", "p/b.py": "import os"}, []),
    ({"p/__init__.py": "", "p/a.py": "from p.b import B", "p/b.py": "def f():\n    from p.a import A"},
     [["p.a", "p.b"]]),
    ({"p/__init__.py": "", "p/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b",
      "p/b.py": "from .a import A"}, [["p.a", "p.b"]]),
    ({"p/__init__.py": "from p.a import A", "p/a.py": "from p import helper"}, [["p", "p.a"]]),
    ({"p/__init__.py": "", "p/a.py": "from q.b import B", "q/__init__.py": "", "q/b.py": "from p.a import A"}, []),
])
def test_the_cycle_check_finds_exactly_the_cycles_inside_a_package(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cycles(_module_names(tmp_path, sorted(tmp_path.rglob("*.py")))) == expected


def test_no_import_cycle_inside_a_package():
    cycles = _cycles(_module_names(ROOT, _source_files()))
    assert cycles == [], (
        "these modules import each other (counting imports inside functions and under TYPE_CHECKING); "
        "move what both need into a module they both import:\n" + "\n".join(" <-> ".join(c) for c in cycles))


# --- no file over 600 lines --------------------------------------------------------------------
#
# Issue 40: a file past 600 lines holds more than one abstraction; split it by responsibility
# (a module named after each), not by line count. Tests count too: a test file mirrors one module.

MAX_LINES = 600


def _long_files(root: Path, paths: list[Path]) -> list[tuple[str, int]]:
    found = []
    for path in paths:
        with path.open("rb") as f:
            num_lines = sum(1 for _ in f)
        if num_lines > MAX_LINES:
            found.append((path.relative_to(root).as_posix(), num_lines))
    return sorted(found)


def test_the_length_check_counts_lines(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_files(tmp_path, sorted(tmp_path.glob("*.py"))) == [("long.py", MAX_LINES + 1)]


def test_no_python_file_is_over_600_lines():
    paths = _source_files() + sorted((ROOT / "tests").rglob("*.py"))
    long = _long_files(ROOT, paths)
    assert long == [], (f"these files are over {MAX_LINES} lines; split each by responsibility into modules "
                        "named after their one abstraction:\n" + "\n".join(f"{f}: {n}" for f, n in long))


# --- one writer of a request's progress ---------------------------------------------------------
#
# Issue 40: ``Sequence.num_computed_tokens`` (how many of a request's tokens have KV) is the
# scheduler's to write: a step reports its batch (`Scheduler.update_from_output`), KV that arrives
# another way is recorded (`Scheduler.record_computed`). Tests count too: they report through it.

PROGRESS = "num_computed_tokens"
PROGRESS_WRITER = "worker/engine/scheduler.py"


def _progress_writes(root: Path, paths: list[Path]) -> list[tuple[str, int]]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                flat = [t for target in targets
                        for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
                if any(isinstance(t, ast.Attribute) and t.attr == PROGRESS for t in flat):
                    found.append((path.relative_to(root).as_posix(), node.lineno))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == PROGRESS):
                found.append((path.relative_to(root).as_posix(), node.lineno))
    return sorted(found)


def test_the_progress_check_finds_every_kind_of_write(tmp_path):
    (tmp_path / "writes.py").write_text(
        "seq.num_computed_tokens = 0\n"
        "seq.num_computed_tokens += 3\n"
        "a.x, seq.num_computed_tokens = 1, 2\n"
        "setattr(seq, 'num_computed_tokens', 4)\n"
        "n = seq.num_computed_tokens\n"                        # a read
        "snap = Snapshot(num_computed_tokens=0)\n"             # a record's field, not a sequence's
        "ok = seq.num_computed_tokens == 3\n")
    assert _progress_writes(tmp_path, [tmp_path / "writes.py"]) == [("writes.py", i) for i in (1, 2, 3, 4)]


def test_only_the_scheduler_writes_a_requests_progress():
    paths = [p for p in _source_files() + sorted((ROOT / "tests").rglob("*.py"))
             if p.relative_to(ROOT).as_posix() != PROGRESS_WRITER]
    writes = _progress_writes(ROOT, paths)
    assert writes == [], (f"only {PROGRESS_WRITER} writes {PROGRESS}; report a step with "
                          "Scheduler.update_from_output, other KV with record_computed:\n"
                          + "\n".join(f"{f}:{n}" for f, n in writes))
    assert _progress_writes(ROOT, [ROOT / PROGRESS_WRITER]), "the writer itself no longer writes it: update the check"


# --- the worker's layers ---------------------------------------------------------------------
#
# Issue 40: worker/ is in subpackages that show its layers, bottom up; a subpackage imports only
# from the layers below it (never from one beside or above it, nor from ``worker`` itself, the
# public face that imports them all). A new subpackage must be given its place here.

WORKER_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"models", "text"}),     # what a checkpoint is and computes; tokens and text
    frozenset({"kv", "loading"}),      # the KV cache's bookkeeping; weights arriving and leaving
    frozenset({"engine"}),             # the continuous-batching loop
    frozenset({"transfer", "serving"}),  # requests moving between engines; an engine served
)


def _layer_violations(root: Path, package: str, layers: tuple[frozenset[str], ...]) -> list[str]:
    files = sorted((root / package).rglob("*.py"))
    modules = _module_names(root, files)
    rank = {sub: i for i, layer in enumerate(layers) for sub in layer}
    found = []
    for module, path in modules.items():
        parts = module.split(".")
        if len(parts) < 2:
            continue  # the package's own __init__: its public face
        if parts[1] not in rank:
            found.append(f"{module}: {parts[1]!r} is not in a layer")
            continue
        for dep in sorted(_imported_modules(module, path, modules)):
            dep_parts = dep.split(".")
            if dep_parts[1:2] == parts[1:2]:
                continue
            if len(dep_parts) < 2 or dep_parts[1] not in rank or rank[dep_parts[1]] >= rank[parts[1]]:
                found.append(f"{module} imports {dep}")
    return found


def test_the_layer_check_finds_an_import_up_or_across(tmp_path):
    for name, text in {"__init__.py": "from w.top.a import A\n", "low/__init__.py": "", "low/a.py": "",
                       "low/b.py": "from w.top import a\n",           # up
                       "top/__init__.py": "", "top/a.py": "import w.low.a\nfrom w.side import c\n",  # down; across
                       "side/__init__.py": "", "side/c.py": "from w import A\n",                    # the face
                       "stray/__init__.py": ""}.items():
        (tmp_path / "w" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "w" / name).write_text(text)
    layers = (frozenset({"low"}), frozenset({"top", "side"}))
    assert _layer_violations(tmp_path, "w", layers) == [
        "w.low.b imports w.top", "w.low.b imports w.top.a", "w.side.c imports w",
        "w.stray: 'stray' is not in a layer", "w.top.a imports w.side", "w.top.a imports w.side.c"]


def test_the_worker_imports_only_down_its_layers():
    subpackages = {p.name for p in (ROOT / "worker").iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set().union(*WORKER_LAYERS), "every worker subpackage has its place in WORKER_LAYERS"
    assert not list((ROOT / "worker").glob("[!_]*.py")), "worker/'s modules live in its layers' subpackages"
    violations = _layer_violations(ROOT, "worker", WORKER_LAYERS)
    assert violations == [], "worker/ imports only down its layers (WORKER_LAYERS):\n" + "\n".join(violations)
