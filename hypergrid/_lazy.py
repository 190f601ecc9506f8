"""Package attributes loaded on first use: the module-level ``__getattr__`` and ``__dir__`` that
``hypergrid`` and ``hypergrid.megatron`` share, so that importing a package does not import the
torch.distributed or megatron-core modules behind some of its names.

Example::

    >>> import types
    >>> package = types.ModuleType("pkg")
    >>> getattr_, dir_ = lazy_attributes("json", {"JSONDecoder": "decoder"}, vars(package))
    >>> getattr_("JSONDecoder")().decode("[1]"), "JSONDecoder" in vars(package), "JSONDecoder" in dir_()
    ([1], True, True)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, table: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name in ``table`` is read from the submodule
    ``table[name]`` on first use and kept in ``namespace`` (the package's ``globals()``), so later
    reads cost nothing."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
