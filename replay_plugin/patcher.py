"""The only way a patch changes upstream objects: reversibly, marked, and only its declared targets.

``install(patcher)`` wraps with :class:`PluginWrapper` (a ``wrapt.FunctionWrapper`` carrying the
patch name as its marker, so ``status`` can prove what is applied). The class attribute is
replaced, not a bound copy. Revert removes exactly this plugin's layer and refuses, with the
reason, when someone else wrapped on top of it or replaced it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import wrapt

from .spec import PatchSpec, UndeclaredTargetError

_MISSING = object()
_MAX_DEPTH = 32


def _resolve(module_name: str, qualname: str) -> Any:
    """``module:qualname`` as the importing process has it (patched there if the plugin is active
    there, the upstream object otherwise): how a :class:`PluginWrapper` is unpickled."""
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class PluginWrapper(wrapt.FunctionWrapper):
    """A ``wrapt.FunctionWrapper`` that carries the name of the patch that installed it.

    wrapt proxies report the wrapped object's ``__class__``: test with
    ``type(obj) is PluginWrapper`` or :func:`patch_marker`, not ``isinstance``.

    Pickled by reference (``module:qualname``, resolved again where it is unpickled). A wrapped
    plain function in a class (``method=True``) is returned as is when looked up on the class
    (``Class.method``; called with the instance first, like the function it wraps) instead of as
    a new wrapt bound proxy. Why: ``ray.remote(cls)`` (Ray 2.x ``_make_actor`` ->
    ``_inject_tracing_into_class``) looks every method up on the class in the driver and keeps it
    in a closure of the subclass it ships to the actor by value; cloudpickle takes a wrapt proxy
    for the function it proxies (``isinstance(proxy, FunctionType)``), finds that the name does not
    lead back to the same object (wrapt makes a new bound proxy per lookup) and pickles the
    *original function* by value. Every patched method of a Ray actor class (verl's
    ``vLLMHttpServer``, ``AgentLoopWorker``) then runs unpatched in the actor. Looked up on the
    class, the wrapper itself is found again, so cloudpickle pickles it by reference and the
    actor resolves it after its own import (patched there by the plugin, or stock).
    """

    def __init__(
        self,
        wrapped: Any,
        wrapper: Callable[..., Any],
        patch_name: str,
        target: tuple[str, str] | None = None,
        method: bool = False,
    ) -> None:
        super().__init__(wrapped, wrapper)
        self._self_replay_patch = patch_name
        self._self_replay_target = target
        self._self_replay_method = method

    @property
    def replay_plugin_patch(self) -> str:
        return self._self_replay_patch

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None and self._self_replay_method:
            return self
        return super().__get__(instance, owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._self_replay_method:
            return super().__call__(*args, **kwargs)
        # looked up on the class: the instance comes first, as for the plain function
        if not args:
            raise TypeError(f"{_describe(self.__wrapped__)}() missing its instance argument")
        instance, rest = args[0], args[1:]
        wrapper: Callable[..., Any] = self._self_wrapper
        return wrapper(functools.partial(self.__wrapped__, instance), instance, rest, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._self_replay_target is None:
            return super().__reduce_ex__(protocol)
        return _resolve, self._self_replay_target


def _is_plugin_wrapper(obj: Any) -> bool:
    return issubclass(type(obj), PluginWrapper)


def _wrapper_chain(obj: Any) -> Iterator[Any]:
    """``obj`` and every object reachable through ``__wrapped__`` (bounded)."""
    for _ in range(_MAX_DEPTH):
        if obj is None:
            return
        yield obj
        obj = getattr(obj, "__wrapped__", None)


def patch_marker(obj: Any) -> str | None:
    """The patch name if ``obj`` is (or, through ``__wrapped__``, contains) our wrapper."""
    for layer in _wrapper_chain(obj):
        if _is_plugin_wrapper(layer):
            return layer._self_replay_patch
    return None


def _own_attr(owner: Any, attr: str) -> Any:
    """``owner``'s own value of ``attr`` (not inherited), or ``_MISSING``."""
    namespace = getattr(owner, "__dict__", None)
    if namespace is None:
        return getattr(owner, attr, _MISSING)
    return namespace.get(attr, _MISSING)


def _describe(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)


@dataclass
class _Change:
    owner: Any
    attr: str
    new: Any
    old: Any  # _MISSING when the attribute came from a base class or did not exist

    def undo(self) -> str | None:
        """Restore the old value; or, when someone changed the attribute since, say why not."""
        current = _own_attr(self.owner, self.attr)
        if current is not self.new:
            where = f"{_describe(self.owner)}.{self.attr}"
            if any(layer is self.new for layer in list(_wrapper_chain(current))[1:]):
                kind = f"{type(current).__module__}.{type(current).__qualname__}"
                return f"{where} was wrapped on top of the plugin by {kind}; left in place"
            return f"{where} was replaced by someone else; left as is"
        if self.old is _MISSING:
            try:
                delattr(self.owner, self.attr)
            except AttributeError:
                pass
        else:
            setattr(self.owner, self.attr, self.old)
        return None


class Patcher:
    """What an ``install`` function uses to change upstream objects, reversibly."""

    def __init__(self, spec: PatchSpec) -> None:
        self.spec = spec
        self.changes: list[_Change] = []
        self._on_revert: list[Callable[[], None]] = []

    def target(self, name: str) -> str:
        """The declared target ``name`` refers to: a full ``module:qualname`` or a qualname that
        ends exactly one of the spec's targets. Anything else raises UndeclaredTargetError."""
        if ":" in name:
            matches = [name] if name in self.spec.targets else []
        else:
            matches = [t for t in self.spec.targets if t.partition(":")[2] == name]
        if len(matches) != 1:
            raise UndeclaredTargetError(
                f"patch {self.spec.name} wraps {name!r}, which is not exactly one of its targets in "
                f"compat_matrix.yaml ({', '.join(self.spec.targets)})"
            )
        return matches[0]

    def wrap(self, name: str, wrapper: Callable[..., Any]) -> PluginWrapper:
        """Wrap the declared target ``name`` with ``wrapper(wrapped, instance, args, kwargs)``.

        Wrapping a target that already carries this patch's marker is a no-op that returns the
        existing wrapper.
        """
        module_name, _, qualname = self.target(name).partition(":")
        parent, attr, original = wrapt.resolve_path(importlib.import_module(module_name), qualname)
        current = inspect.getattr_static(parent, attr)
        if _is_plugin_wrapper(current) and current._self_replay_patch == self.spec.name:
            return current
        method = inspect.isclass(parent) and inspect.isfunction(current)
        wrapper_obj = PluginWrapper(original, wrapper, self.spec.name, target=(module_name, qualname), method=method)
        self._set(parent, attr, wrapper_obj)
        return wrapper_obj

    def _set(self, owner: Any, attr: str, value: Any) -> None:
        old = _own_attr(owner, attr)
        setattr(owner, attr, value)
        self.changes.append(_Change(owner, attr, value, old))

    def displaced(self) -> list[str]:
        """The changes no longer in place: the attribute was since replaced by an object that is
        not this plugin's wrapper and does not reach it through ``__wrapped__`` (a library that
        wraps on top with ``functools.wraps`` leaves the change in place)."""
        out = []
        for change in self.changes:
            current = _own_attr(change.owner, change.attr)
            if any(layer is change.new for layer in _wrapper_chain(current)):
                continue
            where = f"{_describe(change.owner)}.{change.attr}"
            if current is _MISSING:
                out.append(f"{where} was deleted")
            else:
                module = getattr(current, "__module__", None) or type(current).__module__
                out.append(f"{where} was replaced by {module}.{_describe(current)}")
        return out

    def on_revert(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the patch is reverted (after the attribute changes are undone)."""
        self._on_revert.append(callback)

    def revert(self) -> list[str]:
        """Undo the changes in reverse order. Returns the problems (a change someone else wrapped
        on top of, or replaced, is left in place and reported; only those changes stay recorded)."""
        problems, kept = [], []
        for change in reversed(self.changes):
            problem = change.undo()
            if problem:
                problems.append(problem)
                kept.append(change)
        self.changes = kept[::-1]
        if not problems:
            for callback in reversed(self._on_revert):
                callback()
            self._on_revert.clear()
        return problems
