"""The import rule: each package sits on one floor and imports only from floors below it.

Floors, top first; packages on one floor are peers and import nothing from each other. A new
package must be given a floor here, or the test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

FLOORS: list[list[str]] = [
    ["tokenmill.cli"],
    ["tokenmill.cluster"],  # Ray Serve replicas around the server's app; Ray Data batch jobs
    ["tokenmill.server", "tokenmill.bench", "tokenmill.train"],
    ["tokenmill.gateway"],  # several models, routing, the semantic cache: no HTTP
    ["tokenmill"],  # the package root re-exports the offline API
    ["tokenmill.llm"],
    ["tokenmill.engine"],
    ["tokenmill.spec", "tokenmill.structured"],
    ["tokenmill.loader"],
    ["tokenmill.quant"],
    ["tokenmill.model"],
    ["tokenmill.kv"],
    ["tokenmill.scheduler_output"],
    ["tokenmill.draft_tree"],
    ["tokenmill.request"],
    ["tokenmill.sampling"],
    ["tokenmill.kernels"],
    ["tokenmill.config"],
]


def unit_of(module: str, floors: list[list[str]]) -> tuple[int, str] | None:
    """(floor index, unit) of the longest unit name that is `module` or a package above it; the
    root package's own unit holds its `__init__` alone."""
    best: tuple[int, str] | None = None
    for index, units in enumerate(floors):
        for unit in units:
            covers = module == unit or ("." in unit and module.startswith(unit + "."))
            if covers and (best is None or len(unit) > len(best[1])):
                best = (index, unit)
    return best


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path) -> bool:
    relative = Path(*name.split(".")[1:])
    return (root / relative).with_suffix(".py").is_file() or (root / relative).is_dir()


def imported_modules(path: Path, module: str, root: Path) -> list[str]:
    """Every module of the package at `root` that the file imports, at any depth (inside
    functions and TYPE_CHECKING blocks too); `from a import b` counts as `a.b` where b is a
    module, else as `a`."""
    package = root.name
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}", root)]
    return [name for name in found if name == package or name.startswith(package + ".")]


def upward_imports(root: Path, floors: list[list[str]]) -> list[str]:
    """'a -> b' for each import that goes up a floor or sideways to a peer, and
    'a: no floor' for each module the table does not place."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        own = unit_of(module, floors)
        if own is None:
            problems.append(f"{module}: no floor")
            continue
        for target in imported_modules(path, module, root):
            other = unit_of(target, floors)
            if other is None or other[1] == own[1]:
                continue
            if other[0] <= own[0]:
                problems.append(f"{module} -> {target}")
    return sorted(set(problems))


def test_tokenmill_imports_flow_down_only():
    root = Path(tokenmill.__file__).parent
    assert upward_imports(root, FLOORS) == []


def test_an_upward_import_is_reported(tmp_path):
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "high").mkdir()
    for folder in (root, root / "low", root / "high"):
        (folder / "__init__.py").write_text("")
    (root / "high" / "api.py").write_text("from pkg.low.core import f\n")
    (root / "low" / "core.py").write_text("def f():\n    from pkg.high import api\n")
    floors = [["pkg"], ["pkg.high"], ["pkg.low"]]
    assert upward_imports(root, floors) == [
        "pkg.low.core -> pkg.high",
        "pkg.low.core -> pkg.high.api",
    ]


def test_peers_on_one_floor_may_not_import_each_other(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "server.py").write_text("import pkg.bench\n")
    (root / "bench.py").write_text("")
    assert upward_imports(root, [["pkg"], ["pkg.server", "pkg.bench"]]) == [
        "pkg.server -> pkg.bench"
    ]


def test_a_module_without_a_floor_is_reported(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "gateway.py").write_text("")
    assert upward_imports(root, [["pkg"], ["pkg.gateway"]]) == []
    assert upward_imports(root, [["pkg"], ["pkg.other"]]) == ["pkg.gateway: no floor"]
