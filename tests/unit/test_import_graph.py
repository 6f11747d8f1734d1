"""Import facts of trainmover/, read from its source with `ast` (no module of it is imported,
except by the torch check, in a fresh interpreter):

* no cycle between modules;
* no module imports another module's private name: `from x import _y`, or `x._y` on a module
  `x` it imported;
* no import runs up the layers that docs/architecture.md declares ("Layers and allowed import
  directions"), a table this test reads; every module has its layer there, and every entry of
  the table names a module;
* `import trainmover.controller.executor` loads no torch.

Which imports count: every one, for every check: at module level, under `if TYPE_CHECKING:`,
and inside a function. A function-level import is made lazy for its cost (torch, pyslurm,
numba), not for its direction: the module cannot do its job without the other, so a circle
or an upward arrow through it is as real to a reader as one at the top of the file (issue 39's
cycles slurm/client <-> pyslurm_backend and runtime/transfer <-> xferplan ran through lazy
imports). A TYPE_CHECKING import is a use of the other module's names, by the type checker
and the reader alike (switch <-> rank_recovery ran through one).

What is not an import here: a module found by name at run time (`importlib.import_module` of a
string: the workload registry finds the built-in models as it finds a user's class), and the
packages that Python runs before a dotted module: `import a.b.c` is an arrow to a.b.c, not to
a/__init__ and a/b/__init__ (slurm/__init__ re-exports its modules, and would otherwise be in a
cycle with each of them).

Each check also runs on a small synthetic graph or source that it must flag (negative controls).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainmover"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYERS_HEADING = "## Layers and allowed import directions"


# --- reading the source ---------------------------------------------------------------------
@dataclass(frozen=True)
class Module:
    name: str      # trainmover.groups.swappable
    rel: str       # groups/swappable.py (relative to trainmover/)
    is_pkg: bool
    source: str


@dataclass(frozen=True)
class Arrow:
    src: str
    dst: str
    line: int
    where: str     # "module", "type-checking" or "function"


def modules(package: Path = PACKAGE) -> dict[str, Module]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        parts = [package.name] + rel[:-3].split("/")
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = Module(".".join(parts), rel, is_pkg, path.read_text())
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """(node, where) for every import statement, where it sits: in a function (or lambda or
    class body inside one), under `if TYPE_CHECKING:`, or at module level."""
    todo = [(tree, "module")]
    while todo:
        node, where = todo.pop()
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif isinstance(child, ast.If) and where == "module" and _is_type_checking(child.test):
                inner = "type-checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            todo.append((child, inner))


def _base_of(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.name.split(".") if mod.is_pkg else mod.name.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _owner(name: str, known) -> str | None:
    """The module `name` is, or the module that defines it (its longest known prefix)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass(frozen=True)
class Found:
    arrows: list[Arrow]
    privates: list[str]   # "src:line imports dst's _name"


def read(mods: dict[str, Module], top: str = "trainmover") -> Found:
    """Every import arrow between the modules of `mods`, and every use of another module's
    private name (imported by name, or read as an attribute of an imported module)."""
    arrows: list[Arrow] = []
    privates: list[str] = []
    for mod in mods.values():
        tree = ast.parse(mod.source, mod.rel)
        aliases: dict[str, str] = {}  # a local name -> the module of ours it is bound to
        for node, where in _walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] != top:
                        continue
                    dst = _owner(a.name, mods)
                    arrows.append(Arrow(mod.name, dst, node.lineno, where))
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:  # `import a.b.c` binds `a`: attribute chains are resolved below
                        aliases[a.name.split(".")[0]] = a.name.split(".")[0]
                continue
            base = _base_of(mod, node)
            if base.split(".")[0] != top:
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in mods:  # a module: `from pkg import mod`
                    arrows.append(Arrow(mod.name, full, node.lineno, where))
                    aliases[a.asname or a.name] = full
                    if private(a.name):
                        privates.append(f"{mod.name}:{node.lineno} imports module {full}")
                    continue
                dst = _owner(base, mods)
                arrows.append(Arrow(mod.name, dst, node.lineno, where))
                if private(a.name) and dst != mod.name:
                    privates.append(f"{mod.name}:{node.lineno} imports {dst}'s {a.name}")
        for node in ast.walk(tree):  # x._y where x is a module of ours this one imported
            if isinstance(node, ast.Attribute) and private(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    target = ".".join([aliases[value.id]] + chain[::-1])
                    if target in mods and target != mod.name:
                        privates.append(f"{mod.name}:{node.lineno} reads {target}'s {node.attr}")
    return Found(arrows, privates)


def graph(arrows: list[Arrow]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for a in arrows:
        if a.src != a.dst:
            g.setdefault(a.src, set()).add(a.dst)
            g.setdefault(a.dst, set())
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


# --- the layers docs/architecture.md declares -----------------------------------------------
def _expand(entry: str) -> tuple[str, ...]:
    """`controller/{a,b}.py` -> (controller/a.py, controller/b.py); others as they are."""
    m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", entry)
    if not m:
        return (entry,)
    head, names, tail = m.groups()
    return tuple(f"{head}{n.strip()}{tail}" for n in names.split(","))


def layers(text: str) -> list[list[tuple[str, ...]]]:
    """The table under LAYERS_HEADING, bottom to top: per layer its entries, each entry the
    paths (a module `a/b.py` or a package `a/`) it is made of."""
    section = text.split(LAYERS_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            assert int(cells[0]) == len(rows) + 1, f"layer {cells[0]}: layers are numbered 1, 2, ... bottom to top"
            rows.append([_expand(e) for e in re.findall(r"`([^`]+)`", cells[1])])
    assert rows, f"no layer table under {LAYERS_HEADING!r}"
    return rows


def _matches(path: str, rel: str) -> bool:
    return rel == path or (path.endswith("/") and rel.startswith(path))


def place(rel: str, table: list[list[tuple[str, ...]]]) -> tuple[int, tuple[str, ...]] | None:
    """(layer, entry) of the module at `rel`: the most specific entry naming it (a module's own
    path before its folder's)."""
    best = None
    for n, row in enumerate(table, start=1):
        for entry in row:
            for path in entry:
                if _matches(path, rel) and (best is None or len(path) > best[0]):
                    best = (len(path), n, entry)
    return None if best is None else (best[1], best[2])


def upward(arrows: list[Arrow], rel_of: dict[str, str], table) -> list[str]:
    """Every arrow from a layer to a higher one, or between two sibling entries of one layer."""
    bad = []
    for a in arrows:
        (ls, es), (ld, ed) = place(rel_of[a.src], table), place(rel_of[a.dst], table)
        if ld > ls or (ld == ls and es != ed):
            what = "up" if ld > ls else "across"
            bad.append(f"{a.src}:{a.line} ({a.where}) imports {a.dst}: {what}, layer {ls} -> {ld}")
    return bad


# --- the facts of trainmover/ ------------------------------------------------------------
@pytest.fixture(scope="module")
def tree():
    mods = modules()
    return mods, read(mods)


def test_no_import_cycle_between_modules(tree):
    _, found = tree
    assert len(found.arrows) > 500, "the reader found too few imports to judge"
    assert cycles(graph(found.arrows)) == []


def test_no_module_imports_another_modules_private_name(tree):
    _, found = tree
    assert found.privates == []


def test_every_module_has_its_layer_and_every_entry_names_a_module(tree):
    mods, _ = tree
    table = layers(ARCHITECTURE.read_text())
    assert [m.rel for m in mods.values() if place(m.rel, table) is None] == [], \
        f"modules without a layer: add them to {ARCHITECTURE.relative_to(ROOT)}'s table"
    stale = [p for row in table for entry in row for p in entry
             if not any(_matches(p, m.rel) for m in mods.values())]
    assert stale == [], "entries of the layer table that name no module"


def test_no_import_runs_up_the_layers(tree):
    mods, found = tree
    table = layers(ARCHITECTURE.read_text())
    assert upward(found.arrows, {m.name: m.rel for m in mods.values()}, table) == []


# --- negative controls: what each check must flag --------------------------------------------
def _synthetic(files: dict[str, str]) -> dict[str, Module]:
    mods = {}
    for rel, source in files.items():
        parts = ["trainmover"] + rel[:-3].split("/")
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = Module(".".join(parts), rel, is_pkg, source)
    return mods


def test_negative_control_a_cycle_is_found_through_any_kind_of_import():
    mods = _synthetic({
        "__init__.py": "",
        "a.py": "from trainmover import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainmover.c import C\n",
        "c.py": "def f():\n    from trainmover.a import thing\n",   # lazy, and still a circle
        "d.py": "import trainmover.a\n",                            # into the circle, not in it
        "e.py": "from . import f\n",                                # relative: e <-> f
        "f.py": "from .e import x\n",
    })
    found = read(mods)
    assert {a.where for a in found.arrows} == {"module", "type-checking", "function"}
    assert cycles(graph(found.arrows)) == [["trainmover.a", "trainmover.b", "trainmover.c"],
                                           ["trainmover.e", "trainmover.f"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_negative_control_private_names_are_found_imported_or_read():
    mods = _synthetic({
        "__init__.py": "__version__ = '1'\n",
        "transfer.py": "def _flatten(): ...\n_word_view = None\n",
        "xferplan.py": "from trainmover.transfer import _flatten, _word_view\n",
        "holding.py": "from trainmover import transfer\nx = transfer._flatten()\n",
        "capture.py": "import trainmover.transfer\ny = trainmover.transfer._word_view\n",
        "fine.py": "from trainmover import __version__\ndef _own(): ...\nz = _own\n",  # a dunder; its own
    })
    assert sorted(read(mods).privates) == [
        "trainmover.capture:2 reads trainmover.transfer's _word_view",
        "trainmover.holding:2 reads trainmover.transfer's _flatten",
        "trainmover.xferplan:1 imports trainmover.transfer's _flatten",
        "trainmover.xferplan:1 imports trainmover.transfer's _word_view",
    ]


def test_negative_control_an_upward_or_sibling_import_is_flagged():
    table = layers(f"{LAYERS_HEADING}\n\n| layer | packages and modules | what |\n|---|---|---|\n"
                   "| 1 | `errors.py` | x |\n| 2 | `low/{a,b}.py`, `side/` | x |\n| 3 | `low/` | x |\n\n## next\n")
    rel = {"trainmover.errors": "errors.py", "trainmover.low.a": "low/a.py", "trainmover.low.b": "low/b.py",
           "trainmover.low.top": "low/top.py", "trainmover.side.s": "side/s.py"}
    arrows = [Arrow("trainmover.low.a", "trainmover.low.b", 1, "module"),        # one entry: fine
              Arrow("trainmover.low.top", "trainmover.low.a", 2, "module"),      # down: fine
              Arrow("trainmover.low.a", "trainmover.errors", 3, "module"),       # down: fine
              Arrow("trainmover.errors", "trainmover.low.a", 4, "function"),     # up, lazily
              Arrow("trainmover.low.a", "trainmover.low.top", 5, "type-checking"),  # up, in its own folder
              Arrow("trainmover.side.s", "trainmover.low.b", 6, "module")]       # across siblings
    assert upward(arrows, rel, table) == [
        "trainmover.errors:4 (function) imports trainmover.low.a: up, layer 1 -> 2",
        "trainmover.low.a:5 (type-checking) imports trainmover.low.top: up, layer 2 -> 3",
        "trainmover.side.s:6 (module) imports trainmover.low.b: across, layer 2 -> 2",
    ]


def test_negative_control_the_real_table_flags_the_arrows_issue_39_removed(tree):
    """The upward arrows and circles issue 39 names, put back into the real graph."""
    mods, found = tree
    table = layers(ARCHITECTURE.read_text())
    rel = {m.name: m.rel for m in mods.values()}
    back = [Arrow("trainmover.workloads.base", "trainmover.script.workload", 0, "function"),
            Arrow("trainmover.groups.nccl.backend", "trainmover.runtime.transfer.state", 0, "module"),
            Arrow("trainmover.standbys.history", "trainmover.controller.executor", 0, "module")]
    assert len(upward(back, rel, table)) == 3
    again = found.arrows + [Arrow("trainmover.runtime.roles.recovery", "trainmover.runtime.roles.switch", 0, "module"),
                            Arrow("trainmover.slurm.client", "trainmover.slurm.pyslurm_backend", 0, "function")]
    assert cycles(graph(again)) == [["trainmover.runtime.roles.recovery", "trainmover.runtime.roles.switch"],
                                    ["trainmover.slurm.client", "trainmover.slurm.pyslurm_backend"]]


# --- what importing the controller loads --------------------------------------------------
def _loaded_by(module: str) -> list[str]:
    probe = (f"import sys, {module}; "
             "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         check=True)
    return out.stdout.split()


def test_importing_the_controller_loads_no_torch():
    """The controller's process imports torch only when it loads the job's workload (whose own
    code gives its groups), not with its modules: a keeper, a supervisor or a warm successor
    imports them without it."""
    for module in ("trainmover.controller.executor", "trainmover.controller.process",
                   "trainmover.controller.succession.keeper", "trainmover.controller.succession.supervisor"):
        assert _loaded_by(module) == [], f"{module} loads torch at import"
    # negative control: the probe sees torch where a module does import it
    assert "torch" in _loaded_by("trainmover.workloads.gpt_demo")
