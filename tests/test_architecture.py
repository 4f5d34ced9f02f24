"""The package's shape, as docs/architecture.md draws it: which part may import which, no import cycle,
and no module over 400 lines without a line at its top saying why. Read from the source (imports inside
functions included), so nothing has to be imported or started."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ravnest_swarm"
MAX_LINES = 400

# each part and the parts it may import (besides itself and the shared base modules)
BASE = {"errors", "lifecycle", "devices"}
ALLOWED = {
    "net": set(),
    "models": set(),
    "optimizers": set(),
    "codecs": set(),
    "checkpoint": set(),
    # the launcher names the modules it preloads and the entry points it runs by string, as `python -m` does
    "launcher": set(),
    "processes": {"launcher"},
    "membership": {"net", "codecs"},
    "planning": {"membership"},
    "pipeline": {"net", "membership", "models", "optimizers", "codecs"},
    "averaging": {"net", "membership", "codecs"},
    "dashboard": {"membership"},  # its pure modules only: see test_the_dashboard_reaches_no_network
    "swarm": {"net", "membership", "planning", "pipeline", "averaging", "optimizers", "models", "dashboard", "checkpoint",
              "processes", "codecs"},
    "bench": {"net", "membership", "planning", "pipeline", "averaging", "optimizers", "models", "dashboard", "checkpoint",
              "processes", "launcher", "swarm", "codecs"},
    "cli": {"net", "membership", "planning", "pipeline", "averaging", "optimizers", "models", "dashboard", "checkpoint",
            "processes", "swarm", "bench", "codecs"},
    "__main__": {"cli"},
}
# the package's own public API: ``ravnest_swarm.load_model(DIR)`` reads an export (imported when called)
PUBLIC_API = {"ravnest_swarm": {"ravnest_swarm.swarm.exported"}}
# the dashboard draws what it is given: nothing it imports, directly or through other modules, reaches the network
NETWORK = ("hivemind", "ravnest_swarm.net")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path) -> set:
    """Every module ``path`` imports, at the top or inside a function, as dotted names."""
    tree = ast.parse(path.read_text())
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict:
    """Module name -> the project's modules it imports (only those that exist as files or packages)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        graph[name] = {imported for imported in imports_of(path) if imported in paths and imported != name}
    return graph


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_part_imports_only_the_parts_below_it():
    wrong = []
    for module, imported in modules().items():
        part = part_of(module)
        if part in BASE or part == "":
            assert all(part_of(other) in BASE or other in PUBLIC_API.get(module, ()) for other in imported), \
                (module, imported)
            continue
        assert part in ALLOWED, f"{module}: a part docs/architecture.md and this test do not know"
        for other in imported:
            if part_of(other) not in ALLOWED[part] | BASE | {part, ""}:
                wrong.append(f"{module} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_the_dashboard_reaches_no_network():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = modules()
    wrong = []
    for start in (module for module in graph if part_of(module) == "dashboard"):
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            wrong += [f"{start} reaches {name} (through {module})" for name in imports_of(paths[module])
                      if any(name == root or name.startswith(root + ".") for root in NETWORK)]
            todo += graph[module]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = modules()
    # a module importing its own package's __init__ is how Python works, not a cycle of ours
    graph = {module: {other for other in imported if not module.startswith(other + ".")}
             for module, imported in graph.items()}
    cycles, state = [], {}

    def visit(module, trail):
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
            if state.get(other) == "open":
                cycles.append(" -> ".join(trail[trail.index(other):] + [other]))
            elif other not in state:
                visit(other, trail + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_a_module_over_400_lines_says_why_at_its_top():
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any("400 lines" in line for line in lines[:20]):
            unexplained.append(f"{path.relative_to(PACKAGE.parent)}: {len(lines)} lines")
    assert not unexplained, "\n".join(unexplained)


def test_the_walk_in_docs_names_functions_that_exist():
    """docs/architecture.md's walk of a microbatch stays true to the code: every ``part.module.name`` it
    quotes can be imported and looked up."""
    import importlib
    import re

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = []
    for dotted in sorted(set(re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)+)`", text))):
        parts = dotted.split(".")
        if parts[0] not in ALLOWED or parts[-1] == "py":
            continue
        for split in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(["ravnest_swarm", *parts[:split]]))
            except ImportError:
                continue
            try:
                for name in parts[split:]:
                    target = getattr(target, name)
            except AttributeError:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    assert not missing, missing
