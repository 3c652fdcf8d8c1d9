"""The layering of the packages, read from the source with ast: pd_serve never imports bench,
kernels import no private name of another package, and no import circle closes inside pd_serve
or kernels. Imports inside functions count too: a lazy import that closes a circle is still one.
Also: every module path docs/architecture.md names exists."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pd_serve", "kernels", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the packages (bench/results and bench/data hold no code)."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO_ROOT / pkg).rglob("*.py"))
            if "results" not in p.parts}


def imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import, at any depth."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            out += [(base, a.name, node.lineno) for a in node.names]
    return out


def resolve(target: str, taken: str | None, known: dict[str, Path]) -> str | None:
    """The module of ours an import loads: `from a import b` loads a.b when that is a module."""
    if taken and f"{target}.{taken}" in known:
        return f"{target}.{taken}"
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for name, path in known.items():
        for target, taken, _ in imports(name, path):
            dep = resolve(target, taken, known)
            if dep and dep != name and not name.startswith(dep + "."):  # a package's own __init__
                graph[name].add(dep)
    return graph


def cycles(graph: dict[str, set[str]], within: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), among `within`."""
    nodes = [m for m in graph if m.split(".")[0] in within]
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w.split(".")[0] not in within:
                continue
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
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_pd_serve_never_imports_bench():
    bad = sorted({f"{name} line {line}: {target}" for name, path in modules().items()
                  if name.split(".")[0] in ("pd_serve", "kernels")
                  for target, _, line in imports(name, path) if target.split(".")[0] == "bench"})
    assert not bad, "the product imports the benchmarks:\n" + "\n".join(bad)


def test_kernels_import_no_private_name_of_another_package():
    bad = []
    for name, path in modules().items():
        if name.split(".")[0] != "kernels":
            continue
        for target, taken, line in imports(name, path):
            top = target.split(".")[0]
            private = [p for p in target.split(".")[1:] + [taken or ""] if p.startswith("_")
                       and not p.startswith("__")]
            if top in PACKAGES and top != "kernels" and private:
                bad.append(f"{name} line {line}: from {target} import {taken}")
    assert not bad, "kernels import private names:\n" + "\n".join(bad)


def test_no_import_circle_in_pd_serve_or_kernels():
    found = cycles(import_graph(), ("pd_serve", "kernels"))
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_graph_sees_function_level_imports(tmp_path):
    """The walk counts an import inside a function body (as profile.py's lazy imports were)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from pd_serve.cli import main\n", encoding="utf-8")
    assert ("pd_serve.cli", "main", 2) in imports("pd_serve.m", src)
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}
    assert cycles(graph, ("a",)) == [["a.x", "a.y", "a.z"]]


def test_architecture_doc_names_only_paths_that_exist():
    text = (REPO_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\b((?:pd_serve|kernels|bench|tests)/[\w./*]*)", text))
    missing = sorted(p for p in named if not any(REPO_ROOT.glob(p.rstrip("."))))
    assert named, "docs/architecture.md names no module paths"
    assert not missing, "docs/architecture.md names paths that do not exist: " + ", ".join(missing)


def test_engine_and_benchmarks_import_without_the_serving_packages():
    """The in-process Engine and the one-GPU benchmarks need neither zmq nor aiohttp (the
    serving stack's transports): a GPU box with torch and triton alone runs them."""
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('zmq', 'aiohttp'):\n"
               "            raise ImportError('blocked: ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import pd_serve.engine.engine, bench.offline, bench.one_batch\n"
               "from pd_serve import Engine\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'bench'}"}
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
