"""Patch ``skyrl.generator_support_width``: SkyRL's agent loop takes support rows as wide as they come.

Gap (skyrl 0.4.0, ``train/generators/skyrl_gym_generator.py``, ``SkyRLGymGenerator.agent_loop``):
each turn's rows are read as ``np.asarray(rows).reshape(-1, sample_support_width)`` with
``sample_support_width = sampling_params["top_k"]``: SkyRL assumes its own top-k-wide rows. The
plugin's rows are ``top_k + slack`` wide (``skyrl.sample_support_rows``), so the reshape would cut
each row into pieces and the turn would fail its "rows == tokens" check. Nothing else in SkyRL's
rollout, multi-turn accumulation (``SampleSupportTrace``: one schema, whatever the width), batch
building (``build_sample_support``: width from the rows) or trainers depends on the width.

That one expression lives in the middle of a 400-line coroutine with no function boundary around
it, so the patch rewrites only it: at install it parses SkyRL's installed source of
``agent_loop`` (the fingerprint in compat_matrix.yaml pins it), replaces the single call
``<rows>.reshape(-1, sample_support_width)`` by ``_rows_of_their_width(<rows>,
sample_support_width)`` and compiles the function again, with SkyRL's file name, line numbers,
globals and defaults; everything else is SkyRL's own code. ``_rows_of_their_width`` returns a 2-D
array as it is (its own width) and reshapes anything else as SkyRL did: top-k-wide rows give
exactly SkyRL's result. The wrapper calls the rewritten function; revert restores SkyRL's. Remove
when SkyRL reads the width from the rows.

When the generator's config asks for sample support, the wrapper first refuses the job
(``capture_guard.check_once``, once per process) where ``skyrl.sample_support_rows`` is not in
place: this patch would otherwise take SkyRL's own top_k rows as gladly as the plugin's. It covers
the jobs ``skyrl.engine_support_width`` did not check (that patch off, servers started elsewhere).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from ..patcher import Patcher
from ..spec import PatchApplyError

TARGET = "SkyRLGymGenerator.agent_loop"
_WIDTH_NAME = "sample_support_width"
_HELPER = "_rows_of_their_width"


def _rows_of_their_width(rows: Any, width: int) -> Any:
    """``rows`` ``[T, W]`` as they are; anything else ``reshape(-1, width)`` as SkyRL does."""
    if getattr(rows, "ndim", None) == 2:
        return rows
    return rows.reshape(-1, width)


class _ReshapeCall(ast.NodeTransformer):
    """Replaces ``X.reshape(-1, sample_support_width)`` by ``_rows_of_their_width(X, width)``."""

    def __init__(self) -> None:
        self.found = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "reshape"
            and not node.keywords
            and len(node.args) == 2
            and isinstance(node.args[0], ast.UnaryOp)
            and isinstance(node.args[0].op, ast.USub)
            and isinstance(node.args[0].operand, ast.Constant)
            and node.args[0].operand.value == 1
            and isinstance(node.args[1], ast.Name)
            and node.args[1].id == _WIDTH_NAME
        ):
            self.found += 1
            call = ast.Call(func=ast.Name(_HELPER, ast.Load()), args=[func.value, node.args[1]], keywords=[])
            return ast.copy_location(call, node)
        return node


def rewrite(original: Any) -> Any:
    """``original`` (SkyRL's ``agent_loop``) compiled again with the one reshape replaced.

    Raises:
        PatchApplyError: the source holds the reshape not exactly once, or is not one function.
    """
    source = textwrap.dedent(inspect.getsource(original))
    tree = ast.parse(source)
    if len(tree.body) != 1 or not isinstance(tree.body[0], (ast.AsyncFunctionDef, ast.FunctionDef)):
        raise PatchApplyError(f"{TARGET}: its source is not one function definition")
    fn = tree.body[0]
    if fn.decorator_list:
        raise PatchApplyError(f"{TARGET}: decorated; the rewrite handles a plain method only")
    transformer = _ReshapeCall()
    transformer.visit(fn)
    if transformer.found != 1:
        raise PatchApplyError(
            f"{TARGET}: found {transformer.found} calls `.reshape(-1, {_WIDTH_NAME})`, expected exactly 1"
        )
    # The helper reaches the function as a closure variable: SkyRL's module namespace is untouched.
    module = ast.parse(f"def _replay_plugin_factory({_HELPER}):\n    pass\n")
    factory = module.body[0]
    assert isinstance(factory, ast.FunctionDef)
    factory.body = [fn, ast.Return(ast.Name(fn.name, ast.Load()))]
    ast.increment_lineno(module, original.__code__.co_firstlineno - 1)
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {}
    exec(compile(module, original.__code__.co_filename, "exec"), original.__globals__, namespace)
    new = namespace["_replay_plugin_factory"](_rows_of_their_width)
    new.__defaults__ = original.__defaults__
    new.__kwdefaults__ = original.__kwdefaults__
    new.__qualname__ = original.__qualname__
    new.__module__ = original.__module__
    new.__doc__ = original.__doc__
    return new


def install(patcher: Patcher) -> None:
    import importlib

    module_name = patcher.target(TARGET).partition(":")[0]
    owner = importlib.import_module(module_name).SkyRLGymGenerator
    original = inspect.unwrap(inspect.getattr_static(owner, "agent_loop"))
    rewritten = rewrite(original)

    def agent_loop(wrapped, instance, args, kwargs):
        from . import capture_guard

        if capture_guard.requested(getattr(instance, "generator_cfg", None)):
            capture_guard.check_once()
        return rewritten(instance, *args, **kwargs)

    patcher.wrap(TARGET, agent_loop)
