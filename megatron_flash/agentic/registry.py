"""Environments by name (``agentic.env``), built with their keyword parameters (``agentic.env_params``).

Built-ins (``megatron_flash/agentic/envs/``, imported on the first lookup):

  frozenlake  grid walk to a goal around holes          actions l r u d
  sokoban     push boxes onto targets                   actions l r u d
  calculator  arithmetic with a calculator tool         actions calc:<expr> | answer:<int>

Your own environment, either way:

  * register it (class or factory) in a module imported before the run starts::

        from megatron_flash.agentic import SyncEnv, StepResult, register_env

        @register_env("guess")
        class Guess(SyncEnv):
            def __init__(self, *, high: int = 9): ...
            def reset(self, seed: int) -> str: ...
            def step(self, action_text: str) -> StepResult: ...

  * or set ``agentic.env="my_package.my_module:Guess"``; the module is imported on lookup.

``make_env(name, **params)`` always returns an ``Env``: a ``SyncEnv`` comes back wrapped in
``ThreadedEnv``. Parameters the constructor does not accept raise ValueError naming the env and
the parameter; so do values the env rejects.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Union

from megatron_flash.agentic.protocol import Env, SyncEnv, ThreadedEnv
from megatron_flash.named import add, check_name, import_named

EnvFactory = Callable[..., Union[Env, SyncEnv]]
"""An Env/SyncEnv subclass, or a function returning an instance of one."""

_BUILTIN_MODULES = (
    "megatron_flash.agentic.envs.frozenlake",
    "megatron_flash.agentic.envs.sokoban",
    "megatron_flash.agentic.envs.calculator",
)
_ENVS: dict[str, EnvFactory] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first, because importing the modules calls register_env
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator registering an Env/SyncEnv subclass or factory under ``name`` (new, no ':')."""
    check_name(name, what="env")
    _load_builtins()  # so a user env reusing a built-in name fails here, not at first lookup

    def decorate(factory: EnvFactory) -> EnvFactory:
        if not callable(factory):
            raise ValueError(f"env {name!r}: {factory!r} is not a class or a factory function")
        if name in _ENVS:
            raise ValueError(f"env {name!r} is already registered (by {_ENVS[name]!r})")
        return add(_ENVS, name, factory, what="env")

    return decorate


def list_envs() -> list[str]:
    _load_builtins()
    return sorted(_ENVS)


def get_env_factory(name: str) -> EnvFactory:
    """The class or factory registered as ``name``, or named by ``"module:attr"``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    if ":" in name:
        return import_named(name, what="env", noun="Class")
    _load_builtins()
    if name not in _ENVS:
        raise ValueError(f"unknown env {name!r}; known: {', '.join(sorted(_ENVS))} "
                         "(or \"module:Class\")")
    return _ENVS[name]


def make_env(name: str, **params: Any) -> Env:
    """A fresh environment instance; a SyncEnv is wrapped in ThreadedEnv."""
    factory = get_env_factory(name)
    _check_params(name, factory, params)
    try:
        env = factory(**params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"env {name!r}: {e}") from e
    if isinstance(env, SyncEnv):
        return ThreadedEnv(env)
    if isinstance(env, Env):
        return env
    raise ValueError(f"env {name!r}: the factory returned {type(env).__name__}, "
                     "expected an Env or SyncEnv instance")


def _check_params(name: str, factory: EnvFactory, params: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins and C callables: let the call itself complain
    accepted = [p.name for p in signature.parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if not takes_any:
        for key in params:
            if key not in accepted:
                raise ValueError(f"env {name!r} has no parameter {key!r}; "
                                 f"accepted: {', '.join(accepted) or '(none)'}")
    try:
        signature.bind(**params)
    except TypeError as e:
        raise ValueError(f"env {name!r}: bad parameters {sorted(params)}: {e}") from e
