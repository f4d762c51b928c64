"""A package's names, loaded when first used (PEP 562 `__getattr__`).

The layers' packages name their entry points in `__init__`; importing them eagerly made
any one module of a layer load all of it (`kvledger --help` loaded SQLAlchemy, numpy and
the projector). A package lists where each name lives and gets its `__getattr__` here.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`, whose names live in its modules `where`
    (module, relative to the package: the names it defines)."""
    module_of = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        setattr(sys.modules[package], name, value)  # asked once
        return value

    return __getattr__
