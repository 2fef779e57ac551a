"""`litkv.core.names.NameRegistry`, the one registry behind policies and storage formats."""

from __future__ import annotations

import sys

import pytest

from litkv.core.names import NameRegistry
from litkv.kvcache.registry import get_kv_cache_class, known_policies, register_kv_cache
from litkv.kvcache.storage_kinds import known_storages, register_storage


def first() -> None: ...


def second() -> None: ...


def test_register_look_up_and_refuse_a_taken_name() -> None:
    registry: NameRegistry[object] = NameRegistry("thing", ())
    assert registry.register("a")(first) is first
    assert registry.register("a")(first) is first  # the same entry again (a module imported twice)
    assert registry.get("a") is first and registry.get("b") is None and registry.get(3) is None
    with pytest.raises(ValueError, match=r"thing name 'a' is already registered for .*test_names.first"):
        registry.register("a")(second)
    assert registry.names() == ["a"]


def test_names_are_checked_and_entries_too() -> None:
    registry: NameRegistry[object] = NameRegistry("policy", (), forbidden=":")
    for bad in ("", "a:b", 3):
        with pytest.raises(ValueError, match="policy name must be a non-empty string without ':'"):
            registry.register(bad)  # type: ignore[arg-type]

    def only_functions(entry: object) -> None:
        if not callable(entry):
            raise TypeError(f"expected a function, got {entry!r}")

    with pytest.raises(TypeError, match="expected a function, got 5"):
        registry.register("five", only_functions)(5)
    assert registry.names() == []


def test_builtins_are_imported_on_the_first_look_up_and_copies_are_independent() -> None:
    sys.modules.pop("json.tool", None)
    registry: NameRegistry[object] = NameRegistry("thing", ("json.tool",))
    assert "json.tool" not in sys.modules
    assert registry.names() == [] and "json.tool" in sys.modules
    other = registry.copy()
    other.register("b")(second)
    assert registry.get("b") is None and other.get("b") is second


def test_policies_and_storages_share_it() -> None:
    assert {"dense", "h2o", "qh2o"} <= set(known_policies())
    assert {"float", "int8", "int4"} <= set(known_storages())
    with pytest.raises(ValueError, match="storage name 'int8' is already registered for litkv.kvcache.quantized"):
        register_storage("int8")(first)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy name 'h2o' is already registered for litkv.kvcache.h2o"):
        register_kv_cache("h2o")(type("Other", (get_kv_cache_class("dense"),), {}))
