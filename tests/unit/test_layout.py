"""The layout's rules, checked on the source: imports run one way (no file imports a file that imports it
back, function-level imports included), and files stay small (under ~400 lines: one concern a file)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "convoy"
MAX_LINES = 400


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The convoy modules ``name`` imports anywhere in its file (``from a import b`` names module ``a.b``
    where that is a module, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {module for module in found if module in known and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one module (an iterative Tarjan walk)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in order:
            continue
        work = [(start, iter(sorted(graph[start])))]
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        found.append(sorted(part))
            elif child not in order:
                order[child] = low[child] = len(order)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], order[child])
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    files = module_files()
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    assert graph["convoy.control.master"] >= {"convoy.control.api"}, "the import reader missed a known import"
    assert cycles(graph) == []


def test_every_file_stays_small() -> None:
    long = {str(path.relative_to(PACKAGE.parent)): count for path in PACKAGE.rglob("*.py")
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files past {MAX_LINES} lines hold two concerns: split them"


def readme_layout() -> list[str]:
    """The lines of the tree drawn under ``## Layout`` in docs/architecture.md (the README points there)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 2)[1].splitlines()


def listed_paths(lines: list[str]) -> set[str]:
    """Every path the drawing names: each line's names (before the description) under the folders above it."""
    folders: list[tuple[int, str]] = []
    paths = set()
    for line in lines:
        depth = len(line) - len(line.lstrip(" "))
        names = line.strip().split("  ", 1)[0]
        folders = [(d, f) for d, f in folders if d < depth]
        parent = "".join(f for _, f in folders)
        for name in (n.strip() for n in names.split(",")):
            paths.add(parent + name)
            parts = name.rstrip("/").split("/")
            paths.update(parent + "/".join(parts[:end]) + "/" for end in range(1, len(parts)))
            if name.endswith("/") and len(names.split(",")) == 1:
                folders.append((depth, name))
    return paths


def test_the_readme_layout_names_every_module_and_nothing_that_is_gone() -> None:
    root = PACKAGE.parent
    listed = listed_paths(readme_layout())
    missing = sorted(path for path in listed if not (root / path).exists())
    assert missing == [], "the README's layout names paths that are not in the tree"
    workloads = PACKAGE / "workloads"
    modules = {str(path.relative_to(root)) for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" and workloads not in path.parents}
    folders = {str(path.relative_to(root)) + "/" for path in PACKAGE.rglob("*") if path.is_dir()
               and path.name != "__pycache__" and (path.parent == workloads or workloads not in path.parents)}
    assert sorted((modules | folders) - listed) == [], "the README's layout leaves these out: add them"


def test_every_test_file_has_a_name_of_its_own() -> None:
    """pytest imports test files by basename (tests/ has no packages): two with one name stop the whole run."""
    tests = PACKAGE.parent / "tests"
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


LAYERS = {
    "base": ("convoy.errors", "convoy.log", "convoy.ports", "convoy.procs", "convoy.shm", "convoy.local_http",
             "convoy.sanitize"),
    "settings": ("convoy.config", "convoy.roles_config", "convoy.ray_config"),
    "protocol": ("convoy.control.protocol",),
    "control": ("convoy.control",),
    "worker": ("convoy.worker",),
    "agent": ("convoy.agent",),
    "data plane": ("convoy.runtime", "convoy.parallel", "convoy.strategy", "convoy.integrations",
                   "convoy.workloads", "convoy.testing"),
    "launch": ("convoy.launch",),
    "cli": ("convoy.cli",),
    "face": ("convoy", "convoy.__main__"),
}
"""Each module's layer: the longest prefix that names it (``convoy`` alone is the package's public face)."""
MAY_IMPORT = {
    "base": {"base"},
    "settings": {"base", "settings"},
    "protocol": {"base", "settings", "protocol"},
    "control": {"base", "settings", "protocol", "control"},
    "worker": {"base", "settings", "protocol", "worker"},
    "agent": {"base", "settings", "protocol", "worker", "agent"},
    "data plane": {"base", "settings", "worker", "data plane"},
    "launch": {"base", "settings", "protocol", "control", "worker", "agent", "launch"},
    "cli": set(LAYERS),
    "face": set(LAYERS),
}
"""The arrows that may run between layers: down towards ``base``, never up; the control plane never imports the
agent, the worker side or the data plane, and the data plane never imports the control plane or the agent."""
EXCEPTIONS = {("convoy.worker.shards", "convoy.control.shards"): "outside convoy, a script's shards come from the "
              "master's own pure queue, run in-process"}
"""(module, package) arrows against the layers, each with its reason."""


def layer_of(module: str) -> str:
    best, found = -1, ""
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            named = module == prefix or (module.startswith(prefix + ".") and prefix != "convoy")
            if named and len(prefix) > best:
                best, found = len(prefix), layer
    assert found, f"{module} is in no layer: add it to LAYERS"
    return found


def test_layer_of_takes_the_longest_prefix() -> None:
    assert layer_of("convoy.control.protocol.messages") == "protocol"
    assert layer_of("convoy.control.roles.master") == "control"
    assert layer_of("convoy") == "face" and layer_of("convoy.config") == "settings"


def test_imports_run_only_along_the_layers_arrows() -> None:
    files = module_files()
    wrong = []
    for name, path in files.items():
        for target in imports_of(name, path, set(files)):
            excepted = any(name == module and target.startswith(package + ".") for module, package in EXCEPTIONS)
            if layer_of(target) not in MAY_IMPORT[layer_of(name)] and not excepted:
                wrong.append(f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)})")
    assert wrong == [], "arrows against the layers: move the code to the layer both may import"


def test_the_top_level_holds_the_public_face_the_settings_and_the_base_helpers() -> None:
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= 12, loose


def test_no_two_files_have_names_that_differ_only_in_word_order() -> None:
    by_words: dict[tuple[str, ...], set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            by_words.setdefault(tuple(sorted(path.stem.split("_"))), set()).add(path.stem)
    assert {words: names for words, names in by_words.items() if len(names) > 1} == {}
