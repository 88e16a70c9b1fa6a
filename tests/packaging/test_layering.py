"""The Python package's layers are one-way: a module never imports one of a higher layer, so the
import graph between layers has no loop (docs/ARCHITECTURE.md §1); and no two modules import
each other, even within a layer or through an import deferred into a function (a lazy import
only hides a circle in the design). Checked on the source (ast over every module, imports inside
functions and under `TYPE_CHECKING` included), not by importing it."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pagedllm

ROOT = "pagedllm"
PACKAGE_DIR = Path(pagedllm.__file__).parent

# Lowest first; a module belongs to the layer of its longest matching prefix and may import its
# own layer and those below. Every module must fall under a prefix other than the bare root
# (which holds only `pagedllm/__init__.py`), so a new package has to be placed here.
LAYERS: list[tuple[str, ...]] = [
    # leaves: the Rust core, the public parameters and outputs, tokenizers; with the two
    # parameter modules that `EngineArgs` and `SamplingParams` embed
    (
        "pagedllm._core",
        "pagedllm._lazy",
        "pagedllm.config",
        "pagedllm.outputs",
        "pagedllm.sampling_params",
        "pagedllm.tokenizer",
        "pagedllm.spec_decode.config",
        "pagedllm.structured_output.params",
        "pagedllm.kv_events.config",
        "pagedllm.checkpoint",  # checkpoint files read without torch: errors, GGUF, packages
    ),
    ("pagedllm.kernels",),  # Triton kernels and their torch references
    ("pagedllm.attention",),  # paged attention: metadata, CUDA / Rust-CPU / torch dispatch
    ("pagedllm.distributed",),  # tensor parallelism: the process group, the sharded layers
    ("pagedllm.models",),  # the decoder, loader, exports
    ("pagedllm.lora",),  # adapters wrapped around the models' projections
    ("pagedllm.sampling",),  # the sampler and the rows of a verification step
    ("pagedllm.structured_output",),  # grammars, matchers, bitmasks
    ("pagedllm.worker",),  # model runner and cache engine: run the models
    ("pagedllm.kv_transfer",),  # the offload tier's worker side: host pool, copy thread
    ("pagedllm.executor",),  # the ranks of tensor parallelism: worker processes, rank 0's runner
    ("pagedllm.spec_decode",),  # SpecDecoder, the draft model (a second runner-like user)
    ("pagedllm.kv_events",),  # KV events: the publisher (engine side), the subscriber (router)
    ("pagedllm.engine",),  # the step loop over all of the above
    ("pagedllm.pooling",),  # pooling models: the engine's prefill-only variant, the pooler
    ("pagedllm.chat",),  # chat rendering, tool and reasoning parsers: the server's and LLM's
    # the user entry points, each over the ones below it:
    ("pagedllm.entrypoints",),  # the OpenAI-compatible server over one engine
    ("pagedllm.router",),  # data parallelism: the router in front of servers, offline replicas
    ("pagedllm.llm",),  # the offline API, over one engine or the router's offline replicas
    ("pagedllm.cli", ROOT),  # the command line over all of them
]


def module_names() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (the kernels symlink
    followed)."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE_DIR, followlinks=True):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            parts = [ROOT, *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported pagedllm module, line) for every import in the file; `from a import b` names
    module `a.b` when that is a module, else `a`."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                package = package if is_package else package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((target if target in known else base, node.lineno))
    return [(m, line) for m, line in found if m == ROOT or m.startswith(ROOT + ".")]


def layer_prefix(module: str) -> str | None:
    """The declared prefix a module falls under (the longest), None if none."""
    matches = [
        p
        for layer in LAYERS
        for p in layer
        if module == p or (p != ROOT and module.startswith(p + "."))
    ]
    return max(matches, key=len, default=None)


def layer_of(module: str) -> int:
    prefix = layer_prefix(module)
    return next(i for i, layer in enumerate(LAYERS) if prefix in layer)


def import_edges() -> list[tuple[str, str, str]]:
    """(importing module, imported module, file:line) over the whole package."""
    modules = module_names()
    known = {*modules, f"{ROOT}._core"}  # the compiled extension has no source here
    return [
        (module, target, f"{path.relative_to(PACKAGE_DIR.parent)}:{line}")
        for module, path in sorted(modules.items())
        for target, line in imports_of(module, path, known)
    ]


def upward_imports(edges) -> list[str]:
    """The edges that go from a layer to a higher one."""
    return [
        f"{where}: {module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, target, where in edges
        if layer_of(target) > layer_of(module)
    ]


def import_graph(edges) -> dict[str, set[str]]:
    """Module -> the modules it imports. Every module also depends on the root package, which
    Python runs before any of its modules: the root may import none of them (its public names
    resolve lazily), else importing any module would re-enter the root half-initialised."""
    graph: dict[str, set[str]] = {ROOT: set()}
    for module, target, _ in edges:
        graph.setdefault(target, set())
        if target != module:
            graph.setdefault(module, set()).add(target)
    for module in graph:
        if module != ROOT:
            graph[module].add(ROOT)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of every circle (strongly connected component of more than one module), each
    sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_every_module_has_a_declared_layer():
    unplaced = [
        m for m in module_names() if layer_prefix(m) is None or (layer_prefix(m) == ROOT != m)
    ]
    assert not unplaced, f"add these modules to LAYERS: {unplaced}"


def test_the_scan_finds_the_models_import_of_attention():
    edges = {(module, target) for module, target, _ in import_edges()}
    assert ("pagedllm.models.decoder", "pagedllm.attention.paged") in edges
    assert ("pagedllm.worker.model_runner", "pagedllm.sampling.verification") in edges


def test_an_upward_import_is_reported():
    edge = ("pagedllm.models.decoder", "pagedllm.worker.model_runner", "models/decoder.py:1")
    assert upward_imports([edge]) == [
        "models/decoder.py:1: pagedllm.models.decoder (layer 4) imports "
        "pagedllm.worker.model_runner (layer 8)"
    ]


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_edges()) == []


def test_a_cycle_is_reported_with_its_modules():
    edges = [
        ("pagedllm.llm", "pagedllm.router.offline", "llm.py:1"),
        ("pagedllm.router.offline", "pagedllm.llm", "router/offline.py:2"),
        ("pagedllm.llm", "pagedllm.config", "llm.py:3"),
    ]
    assert import_cycles(import_graph(edges)) == [["pagedllm.llm", "pagedllm.router.offline"]]


def test_the_root_package_importing_a_module_is_a_cycle():
    edges = [(ROOT, "pagedllm.worker.cpu_threads", "__init__.py:1")]
    assert import_cycles(import_graph(edges)) == [[ROOT, "pagedllm.worker.cpu_threads"]]


def test_no_module_imports_itself_back():
    assert import_cycles(import_graph(import_edges())) == []


def test_models_never_import_the_worker():
    edges = [
        where
        for module, target, where in import_edges()
        if module.startswith("pagedllm.models") and target.startswith("pagedllm.worker")
    ]
    assert edges == []


def test_the_entry_points_are_layers_of_their_own():
    top = [layer_of(m) for m in ("pagedllm.entrypoints", "pagedllm.router", "pagedllm.llm")]
    assert top == sorted(set(top)) and layer_of("pagedllm.cli") == len(LAYERS) - 1
    edge = ("pagedllm.entrypoints.api_server", "pagedllm.router.app", "entrypoints/api_server.py:1")
    assert len(upward_imports([edge])) == 1


def test_the_offline_api_never_imports_the_server():
    edges = [
        where
        for module, target, where in import_edges()
        if module == "pagedllm.llm" and target.startswith("pagedllm.entrypoints")
    ]
    assert edges == []


def test_the_worker_never_imports_spec_decode():
    edges = [
        where
        for module, target, where in import_edges()
        if module.startswith("pagedllm.worker") and target.startswith("pagedllm.spec_decode")
    ]
    assert edges == []
