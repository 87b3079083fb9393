"""The package's import graph has no circle (the house's circles came back
once, between the pool and the worker and between ``ds4 bench`` and its pool
bench, before this test held them), and the store is one door: none of its
parts imports the store back, and no module outside it reaches its index.

Every ``import`` and ``from ... import`` statement of every module under
``python/ds4/`` counts, wherever it stands (a function's lazy import and a
``TYPE_CHECKING`` one too: a circle of types is still a circle). An
import of a module's own package (``from . import X``) is the package's
face, not a part, and does not count for a circle; nor do names a module
resolves at run time (``importlib``)."""

from __future__ import annotations

import ast
import os
import re

import ds4

ROOT = os.path.dirname(os.path.abspath(ds4.__file__))


def _modules() -> dict[str, str]:
    """Dotted module name -> file."""
    out = {}
    for d, _dirs, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(d, f)
    return out


def _targets(mod: str, is_pkg: bool, node: ast.AST, known: set[str]) -> set[str]:
    """The package's modules ``node`` imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            head = ".".join([*base, node.module] if node.module else base)
        else:
            head = node.module or ""
        names = [head] + [f"{head}.{a.name}" for a in node.names]
    else:
        return set()
    out = set()
    for n in names:
        while n and n not in known:  # a name imported from a module: that module
            n = n.rpartition(".")[0]
        if n:
            out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        for node in ast.walk(tree):
            for t in _targets(m, is_pkg, node, known):
                if t != m and not m.startswith(t + "."):  # not the module itself, nor its own package
                    edges[m].add(t)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_circle():
    edges = graph()
    assert len(edges) > 80 and "ds4.server.pool" in edges["ds4.server.worker"], "the graph was read"
    assert circles(edges) == []


def test_the_circle_finder_finds_a_circle():
    # the pool importing the worker again (as it did) is a circle of two
    edges = graph()
    edges["ds4.server.pool"].add("ds4.server.worker")
    assert ["ds4.server.pool", "ds4.server.worker"] in circles(edges)


def _package_imports(path: str) -> list[int]:
    """The lines of ``path`` that import a name of its own package's face
    (``from . import KVStore``; ``from . import sibling`` is a module)."""
    here = os.path.dirname(path)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and n.level == 1
        and n.module is None
        and any(not os.path.exists(os.path.join(here, a.name + ".py")) for a in n.names)
    ]


def test_no_part_of_the_store_imports_the_store_back():
    """The store's parts take what they need (``kvstore/parts.py``'s
    ``StoreParts``, or narrower), never the whole ``KVStore``: not even for
    a type."""
    back = {
        name: lines
        for name, path in _modules().items()
        if name.startswith("ds4.kvstore.") and (lines := _package_imports(path))
    }
    assert back == {}


def test_no_module_outside_the_store_reaches_its_index():
    """Outside ``ds4/kvstore/`` the store is used through its methods: its
    index (``store.index``, and the core's ``StoreIndex`` inside it) is the
    store's own."""
    reach = re.compile(r"\bstore\.index\b|\.index\.idx\b|\.index\._idx\b")
    found = []
    for name, path in _modules().items():
        if name.startswith("ds4.kvstore"):
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"{name}:{i}" for i, line in enumerate(f, 1) if reach.search(line)]
    assert found == []
