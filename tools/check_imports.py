#!/usr/bin/env python3
"""Checks the package's wings (docs/design.md section 1) by reading the
source, without importing it:

- no import cycle between comera's modules (module-level and in-function
  imports alike; a module's implicit import of its parent package is not an
  edge);
- every import points down the wings: ops <- layers <- adapt, convert, storage
  <- integrations <- pretrain (the package's ``__init__`` sits on top);
- the library never imports ``comera.pretrain`` (the application);
- no in-function import of a comera module in the library (such imports hide
  cycles), except the lazy ``transformers``-bound names listed in ALLOWED.

Prints one line per problem and exits 1 if there is any.

Example:
    $ python tools/check_imports.py
    comera: 40 modules, 0 cycles, 0 problems
"""
import ast
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "comera")

# wing of each module prefix: a module may import its own wing and lower ones
WINGS = [
    ("comera._C", 0), ("comera._cuda", 0), ("comera._version", 0), ("comera.ops", 0),
    ("comera.layers", 1),
    ("comera.adapt", 2), ("comera.convert", 2), ("comera.storage", 2),
    ("comera.integrations", 3),
    ("comera.pretrain", 4), ("comera.__main__", 4),
    ("comera", 5),  # the package __init__: the public names
]
# (module, imported) pairs allowed inside a function, with the reason
ALLOWED = {
    ("comera.integrations.hf", "comera.integrations.hf.trainer"):
        "the Trainer glue imports transformers: loaded on first access",
}


def wing(module: str) -> int:
    for prefix, level in WINGS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    raise ValueError(f"{module}: no wing")


def modules() -> dict:
    """module name -> file path, for every .py file of the package."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, ".."))
                name = rel[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(dirpath, f)
    return out


def resolve(target: str, known: dict) -> str:
    """The longest known module that ``target`` names (``a.b.func`` -> ``a.b``)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def imports_of(name: str, path: str, known: dict):
    """(imported module, in a function?) for each comera import in a file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in child.names]
            for t in targets:
                if t == "comera" or t.startswith("comera."):
                    m = resolve(t, known)
                    if m and m != name and not name.startswith(m + "."):
                        found.append((m, inner))
            visit(child, inner)

    visit(tree, False)
    return found


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    known = modules()
    graph, problems = {}, []
    for name, path in sorted(known.items()):
        graph[name] = set()
        for m, in_function in imports_of(name, path, known):
            graph[name].add(m)
            library = wing(name) < 4
            if library and m.startswith("comera.pretrain"):
                problems.append(f"{name} imports the application {m}")
            if wing(m) > wing(name):
                problems.append(f"{name} (wing {wing(name)}) imports {m} (wing {wing(m)}): upward")
            if in_function and library and (name, m) not in ALLOWED:
                problems.append(f"{name} imports {m} inside a function")
    found = cycles(graph)
    for comp in found:
        problems.append("import cycle: " + " -> ".join(comp))
    for p in problems:
        print(p)
    print(f"comera: {len(known)} modules, {len(found)} cycles, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
