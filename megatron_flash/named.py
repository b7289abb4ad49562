"""One rule for extension points: a registered name, or "module:attr" naming your own object.

Losses, rewards, dynamic filters and environments are each an allowlist (a registry dict filled by
decorators, lazily imported). Each also accepts "package.module:attr" for a user's object, imported
when the component is built. `lookup` is that rule, with errors that name the kind, the value and
what is known.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, MutableMapping, TypeVar

T = TypeVar("T")


def check_name(name: Any, *, what: str) -> str:
    """A registrable name: a non-empty string without ':' (which marks "module:attr")."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"{what} name must be a non-empty string without ':', got {name!r}")
    return name


def add(registry: MutableMapping[str, Any], name: str, obj: T, *, what: str) -> T:
    """`registry[name] = obj`, refusing a name already taken."""
    if name in registry:
        raise ValueError(f"{what} {name!r} is already registered")
    registry[name] = obj
    return obj


def registrar(registry: MutableMapping[str, Any], *, what: str) -> Callable[[str], Callable[[T], T]]:
    """`register(name)`: a decorator that puts the decorated object in `registry` under a new `name`."""
    def register(name: str) -> Callable[[T], T]:
        check_name(name, what=what)
        return lambda obj: add(registry, name, obj, what=what)
    return register


def import_named(spec: str, *, what: str, noun: str = "function") -> Any:
    """The callable named by "module:attr"; ValueError naming `what` when it cannot be imported or
    is not callable."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {spec!r}: cannot import {attr!r} from {module_name!r}: {e}") from e
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is not a callable {noun}")
    return obj


def lookup(name: str, registry: Mapping[str, Any], *, what: str, noun: str = "function") -> Any:
    """`registry[name]`, or the object "module:attr" names (imported now)."""
    if ":" in name:
        return import_named(name, what=what, noun=noun)
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))} (or \"module:{noun}\")")
    return registry[name]
