"""Names a package resolves on first access, so importing the package stays cheap (no torch for
`pagedllm --help`, no triton where only the torch references are wanted)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def lazy_names(
    package: str, where: dict[str, str], also: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's `__getattr__` and `__dir__` for `where` (public name -> the submodule that
    defines it); `also`: other names `dir()` lists (eager submodules)."""
    listed = sorted([*where, *also])

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(importlib.import_module(package))[name] = value
        return value

    def __dir__() -> list[str]:
        return listed

    return __getattr__, __dir__
