"""Policy name -> `KVCache` class. Built-in and user policies are registered the same way, with the
`register_kv_cache` decorator; a `"package.module:Class"` path is accepted anywhere a name is."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from litkv.core.names import NameRegistry
from litkv.kvcache.base import KVCache

__all__ = [
    "register_kv_cache",
    "get_kv_cache_class",
    "known_policies",
    "check_policy_name",
    "check_policy_loadable",
]

# Modules whose classes register the built-in policies; imported on the first lookup.
_BUILTIN_MODULES = (
    "litkv.kvcache.dense",
    "litkv.kvcache.last_recent",
    "litkv.kvcache.h2o",
    "litkv.kvcache.qh2o",
    "litkv.kvcache.tova",
    "litkv.kvcache.knorm",
    "litkv.kvcache.keydiff",
    "litkv.kvcache.snapkv",
    "litkv.kvcache.expected_attention",
    "litkv.kvcache.learned",
    "litkv.kvcache.kvzip",
)
_REGISTRY: NameRegistry[type[KVCache]] = NameRegistry("policy", _BUILTIN_MODULES, forbidden=":")


def register_kv_cache(name: str) -> Callable[[type[KVCache]], type[KVCache]]:
    """Class decorator: make a `KVCache` subclass available as policy `name`.

    Registering another class under a name that is taken is a ValueError (re-importing the same
    module replaces its own classes).
    """

    def check(cls: object) -> None:
        if not (isinstance(cls, type) and issubclass(cls, KVCache)):
            raise TypeError(f"register_kv_cache({name!r}) expects a KVCache subclass, got {cls!r}")

    return _REGISTRY.register(name, check)


def known_policies() -> list[str]:
    """Names usable as `KVCacheConfig.policy`, sorted."""
    return _REGISTRY.names()


def check_policy_name(name: str) -> None:
    """Raise ValueError naming the known policies if `name` is neither known nor a `module:Class` path."""
    if ":" not in name and _REGISTRY.get(name) is None:
        raise ValueError(f"unknown KV cache policy {name!r}; known policies: {', '.join(known_policies())}")


def get_kv_cache_class(name: str) -> type[KVCache]:
    """The class for a policy name or a `"package.module:Class"` path."""
    check_policy_name(name)
    cls = _REGISTRY.get(name)
    if cls is not None:
        return cls
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} for policy {name!r}: {err}") from err
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise ValueError(f"policy {name!r}: {attr!r} in {module_name!r} is not a KVCache subclass")
    return cls


def check_policy_loadable(name: object, source: str) -> None:
    """ValueError unless `name` resolves to a policy without importing anything or resolving a new name.

    For policy names read from data (a state file, a store entry, a session): such a name may only be a
    policy registered in this process, or a `"module:Class"` path whose module is already imported. A
    file never makes litkv import a module (module top-level code would run), see docs/state.md.

    Args:
        name: the policy name found in the data.
        source: what the name was read from, for the message (e.g. a file path).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source}: the policy name must be a non-empty string, got {name!r:.80}")
    if _REGISTRY.get(name) is not None:
        return
    hint = "import the module that defines it, or register it with litkv.kvcache.register_kv_cache, before loading"
    if ":" not in name:
        raise ValueError(f"{source} names policy {name!r}, which is not registered in this process; {hint}")
    module_name, _, attr = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(
            f"{source} names policy {name!r} from module {module_name!r}, which is not imported in this process "
            f"(a file never makes litkv import a module); {hint}"
        )
    cls = vars(module).get(attr)  # a plain lookup: no module __getattr__ is called
    if not (isinstance(cls, type) and issubclass(cls, KVCache)):
        raise ValueError(f"{source} names policy {name!r}: {attr!r} in {module_name!r} is not a KVCache subclass")
