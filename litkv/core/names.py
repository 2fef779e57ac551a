"""Things found by name (cache policies, storage formats): one registry of entries that register
themselves with a decorator when their module is imported, and built-in modules imported on the first
lookup."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["NameRegistry"]

T = TypeVar("T")


class NameRegistry(Generic[T]):
    """Names -> entries of one kind.

    Args:
        kind: what the entries are, for messages (`"policy"`, `"storage"`).
        builtin_modules: modules whose import registers the built-in entries (imported on the first lookup).
        forbidden: characters a name may not hold (a policy name has no `':'`, which marks `module:Class`).
    """

    def __init__(self, kind: str, builtin_modules: tuple[str, ...], forbidden: str = "") -> None:
        self.kind = kind
        self.builtin_modules = builtin_modules
        self.forbidden = forbidden
        self._entries: dict[str, T] = {}
        self._builtins_loaded = False

    def register(self, name: str, check: Callable[[object], None] | None = None) -> Callable[[T], T]:
        """A decorator that makes its argument (checked by `check`, which raises) the entry `name`.

        Another entry under a name that is taken is a ValueError (re-importing the same module replaces its
        own entries); so is a name that is not a non-empty string or holds a `forbidden` character.
        """
        if not isinstance(name, str) or not name or any(c in name for c in self.forbidden):
            without = "".join(f" without {c!r}" for c in self.forbidden)
            raise ValueError(f"{self.kind} name must be a non-empty string{without}, got {name!r}")

        def decorator(entry: T) -> T:
            if check is not None:
                check(entry)
            taken = self._entries.get(name)
            if taken is not None and _qualified(taken) != _qualified(entry):
                raise ValueError(f"{self.kind} name {name!r} is already registered for {_qualified(taken)}")
            self._entries[name] = entry
            return entry

        return decorator

    def names(self) -> list[str]:
        """The registered names (built-ins included), sorted."""
        self._load_builtins()
        return sorted(self._entries)

    def get(self, name: object) -> T | None:
        """The entry registered as `name`, or `None`."""
        self._load_builtins()
        return self._entries.get(name) if isinstance(name, str) else None

    def copy(self) -> NameRegistry[T]:
        """An independent registry with the same entries (for tests that register and undo)."""
        self._load_builtins()
        other = NameRegistry[T](self.kind, self.builtin_modules, self.forbidden)
        other._entries = dict(self._entries)
        other._builtins_loaded = True
        return other

    def _load_builtins(self) -> None:
        if not self._builtins_loaded:
            self._builtins_loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)


def _qualified(entry: object) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
