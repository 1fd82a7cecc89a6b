"""The layers of README's picture, checked on the imports of every module of cgroupd/
(parsed, not run): pure core -> JetStream adapter -> runtime -> edges. A module imports
only from its own layer or those below it, and nats-py only from the adapter."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cgroupd"

#: Every module of cgroupd/, by layer (a new module must be placed here).
LAYERS: dict[str, set[str]] = {
    # No I/O: configs, names, rules, errors.
    "core": {"config", "consumerinfo", "errors", "exits", "lazyimport", "logs", "naming",
             "ordering", "partitions", "pinning", "records", "redact", "retrying",
             "settings", "tasks", "timestamps"},
    # The only modules that talk to nats-py and build $JS.API requests.
    "adapter": {"adapter", "connect", "events", "jetstream", "jsapi", "lease", "message",
                "groupstreams", "jserrors", "natsload", "pull", "streamread"},
    # The member runtime (elections, rebalances, the dispatcher) and the admin API.
    "runtime": {"admin", "admin._groups", "admin._status", "calling", "dispatch",
                "keyqueues", "lag", "member", "replay", "runtime", "settlements",
                "runtime.config_watch", "runtime.core",
                "runtime.election_pinned", "runtime.election_sync", "runtime.generation",
                "runtime.pinned_acks", "runtime.rebalance", "runtime.rebalance_pinned",
                "runtime.listener", "runtime.release", "runtime.selfcheck", "runtime.state"},
    # What users and operators touch: the public package, the CLI and daemon, Spark.
    "edges": {"__init__", "__main__", "cli", "daemon", "demo", "handlers", "metrics",
              "cli.application", "cli.context", "cli.demo", "cli.errors", "cli.groups",
              "cli.console", "cli.join", "cli.members", "cli.observe", "cli.options",
              "cli.parsers", "cli.replay", "console", "console._actions", "console._server",
              "console._watch", "embedded", "healthwatch", "joinoptions", "joinrun",
              "loopmonitor", "natscontext", "operations", "probes",
              "spark", "spark.directget", "spark.driver", "spark.layout", "spark.lease",
              "spark.offsets", "spark.options", "spark.rows", "spark.source", "spark.wire",
              "spark.writer", "views", "views._events", "views._groups", "views._status",
              "views._text", "views._watch"},
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
            # `from cgroupd import jsapi` imports the module cgroupd.jsapi.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def test_every_module_has_a_layer() -> None:
    """A new module is placed in the picture, and the picture names no missing module."""
    assert set(MODULES) - set(LAYER_OF) == set()
    assert set(LAYER_OF) - set(MODULES) == set()


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
    through cgroupd.adapter.JetStreamPort, the core does no I/O."""
    nats = sorted(i for i in _imports(MODULES[name]) if i == "nats" or i.startswith("nats."))
    assert nats == [], f"{name} imports {nats}"


#: Edges that still talk to nats-py directly: the demo publishes and sets up its own
#: streams, Spark runs its own wire protocol on executors.
EDGE_NATS = {"demo"} | {n for n in LAYERS["edges"] if n.startswith("spark")}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if LAYER_OF[n] == "edges"))
def test_edges_reach_nats_through_the_adapter(name: str) -> None:
    """The daemon, CLI, handlers and the rest of the edges use the adapter, not nats-py."""
    nats = sorted(i for i in _imports(MODULES[name]) if i == "nats" or i.startswith("nats."))
    if name in EDGE_NATS:
        return
    assert nats == [], f"{name} imports {nats}"


def test_core_never_loads_the_adapter_or_nats_transitively() -> None:
    """Following imports from every core module reaches only core modules."""
    for name in LAYERS["core"]:
        for imported in _imports(MODULES[name]):
            assert not imported.startswith("nats"), (name, imported)
            target = imported.removeprefix("cgroupd.")
            if imported.startswith("cgroupd.") and target in LAYER_OF:
                assert LAYER_OF[target] == "core", (name, target)
