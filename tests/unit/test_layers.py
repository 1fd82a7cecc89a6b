"""The layers of README's picture, checked on the imports of every module of cgroupd/
(parsed, not run): pure core -> JetStream adapter -> runtime -> edges. A module imports
only from its own layer or those below it, and nats-py only from the adapter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cgroupd"

#: Each layer is a set of folders of cgroupd/ (a module's layer is its top folder), so a
#: new module is placed by where it is written. The package's own __init__ and __main__
#: are edges: they re-export the public API and run the command line.
LAYER_FOLDERS: dict[str, set[str]] = {
    # No I/O: configs, names, rules, errors.
    "core": {"core"},
    # The only modules that talk to nats-py and build $JS.API requests.
    "adapter": {"nats"},
    # The member runtime (elections, rebalances, the dispatcher) and the admin API.
    "runtime": {"member", "admin"},
    # What users and operators touch: the CLI, the daemon, the console, Spark, the demo.
    "edges": {"__init__", "__main__", "cli", "console", "demo", "join", "spark", "views"},
}
ORDER = ["core", "adapter", "runtime", "edges"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (TYPE_CHECKING imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import (use cgroupd.<module>)")
            base = node.module or ""
            names.add(base)
            # `from cgroupd.nats import jsapi` imports the module cgroupd.nats.jsapi.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
FOLDER_LAYER = {folder: layer for layer, folders in LAYER_FOLDERS.items() for folder in folders}
LAYER_OF = {name: FOLDER_LAYER[name.split(".")[0]] for name in MODULES
            if name.split(".")[0] in FOLDER_LAYER}


def test_every_module_has_a_layer() -> None:
    """cgroupd/ holds no loose module: each lives in a folder that names its layer."""
    assert set(MODULES) - set(LAYER_OF) == set()
    assert {name.split(".")[0] for name in MODULES} == set(FOLDER_LAYER)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str) -> None:
    """A module imports cgroupd modules of its own layer or lower layers only."""
    layer = ORDER.index(LAYER_OF[name])
    upward = []
    for imported in _imports(MODULES[name]):
        if not imported.startswith("cgroupd."):
            continue
        target = imported.removeprefix("cgroupd.")
        if target not in LAYER_OF:
            continue  # a name inside a module (from cgroupd.x import Name)
        if ORDER.index(LAYER_OF[target]) > layer:
            upward.append(f"{target} ({LAYER_OF[target]})")
    assert upward == [], f"{name} ({LAYER_OF[name]}) imports upward: {upward}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES
                                        if LAYER_OF[n] in ("core", "runtime")))
def test_only_the_adapter_imports_nats(name: str) -> None:
    """Core and runtime modules never import nats-py: the runtime reaches JetStream
    through cgroupd.nats.adapter.JetStreamPort, the core does no I/O."""
    nats = sorted(i for i in _imports(MODULES[name]) if i == "nats" or i.startswith("nats."))
    assert nats == [], f"{name} imports {nats}"


#: Edges that still talk to nats-py directly: the demo publishes and sets up its own
#: streams, Spark runs its own wire protocol on executors.
EDGE_NATS = {n for n in MODULES if n.split(".")[0] in ("demo", "spark")}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if LAYER_OF[n] == "edges"))
def test_edges_reach_nats_through_the_adapter(name: str) -> None:
    """The daemon, CLI, handlers and the rest of the edges use the adapter, not nats-py."""
    nats = sorted(i for i in _imports(MODULES[name]) if i == "nats" or i.startswith("nats."))
    if name in EDGE_NATS:
        return
    assert nats == [], f"{name} imports {nats}"


def test_core_never_loads_the_adapter_or_nats_transitively() -> None:
    """Following imports from every core module reaches only core modules."""
    for name in (n for n in MODULES if LAYER_OF[n] == "core"):
        for imported in _imports(MODULES[name]):
            assert not imported.startswith("nats"), (name, imported)
            target = imported.removeprefix("cgroupd.")
            if imported.startswith("cgroupd.") and target in LAYER_OF:
                assert LAYER_OF[target] == "core", (name, target)
