"""The Python package's layers are one-way: a module never imports one of a higher layer, so the
import graph between layers has no loop (docs/ARCHITECTURE.md §1). Checked on the source (ast
over every module, imports inside functions and under `TYPE_CHECKING` included), not by
importing it."""

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
    # user entry points; the data-parallel router in front of `serve` processes
    ("pagedllm.llm", "pagedllm.entrypoints", "pagedllm.router", "pagedllm.cli", ROOT),
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


def test_models_never_import_the_worker():
    edges = [
        where
        for module, target, where in import_edges()
        if module.startswith("pagedllm.models") and target.startswith("pagedllm.worker")
    ]
    assert edges == []


def test_the_worker_never_imports_spec_decode():
    edges = [
        where
        for module, target, where in import_edges()
        if module.startswith("pagedllm.worker") and target.startswith("pagedllm.spec_decode")
    ]
    assert edges == []
