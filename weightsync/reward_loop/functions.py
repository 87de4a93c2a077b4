"""Custom reward functions: loading ``custom_reward_function`` and calling any reward function.

``get_custom_reward_fn(config)`` (verl's name) reads ``config.custom_reward_function``
(``path``: a Python file, ``name``: a function in it, default ``compute_score``;
``reward_kwargs``: extra keyword arguments, which win over the call's) and returns the function
wrapped with those arguments, or None when no path is set. A missing file, a file that fails to
import or a missing name is an error that names it. Sync and async functions are both kept as
they are: ``is_async(fn)`` tells them apart and ``call_reward_fn`` runs either without blocking
the event loop (a sync one in the loop's default executor, as verl does).

The signature a reward function is called with (verl's): ``fn(data_source=..., solution_str=...,
ground_truth=..., extra_info=..., **extra)`` where ``extra`` holds ``reward_router_address`` and
``reward_model_tokenizer`` when a reward model is enabled (and the manager's own keywords, e.g.
``strict_box_verify`` from the DAPO manager). It returns a float, or a dict with ``"score"``
and any other entries (kept as ``reward_extra_info``).

Callers: reward managers (``weightsync.reward_loop.managers``) inside a ``RewardLoopWorker``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_FUNCTION_NAME = "compute_score"


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function and the sample."""


def get_custom_reward_fn(config: Any) -> Callable[..., Any] | None:
    """The configured custom reward function (``reward_kwargs`` bound), or None."""
    section = _get(config, "custom_reward_function") or {}
    path = _get(section, "path")
    if not path:
        return None
    name = _get(section, "name") or DEFAULT_FUNCTION_NAME
    kwargs = dict(_get(section, "reward_kwargs") or {})
    fn = load_function(str(path), str(name))
    return bind_kwargs(fn, kwargs) if kwargs else fn


def load_function(path: str, name: str) -> Callable[..., Any]:
    """``name`` from the Python file at ``path`` (imported as its own module)."""
    where = f"custom_reward_function.path {path!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: no such file")
    module_name = "weightsync_custom_reward_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{where}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ImportError(f"{where}: importing it failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and
                       getattr(v, "__module__", None) == module_name)
        raise AttributeError(f"custom_reward_function.name {name!r}: {path} has no function of "
                             f"that name (its functions: {', '.join(found) or 'none'})")
    return fn


def bind_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    """``fn`` with ``kwargs`` merged into every call (they win), keeping sync or async."""
    extra = dict(kwargs)
    if is_async(fn):
        @functools.wraps(fn)
        async def bound_async(*args: Any, **kw: Any) -> Any:
            return await fn(*args, **{**kw, **extra})

        return bound_async

    @functools.wraps(fn)
    def bound(*args: Any, **kw: Any) -> Any:
        return fn(*args, **{**kw, **extra})

    return bound


def is_async(fn: Callable[..., Any]) -> bool:
    """True for a coroutine function (also behind ``functools.partial`` or a callable object)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    call = type(fn).__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) else fn
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


async def call_reward_fn(fn: Callable[..., Any], *, what: str, **kwargs: Any) -> Any:
    """Run ``fn(**kwargs)``: awaited when async, else in the loop's default executor. A failure
    is a ``RewardFunctionError`` naming the function and ``what`` (the sample)."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        if is_async(fn):
            return await fn(**kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(fn, **kwargs))
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {name} raised on {what}: {type(e).__name__}: {e}") from e


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, Mapping):
        return node.get(key)
    getter = getattr(node, "get", None)
    return getter(key) if callable(getter) else getattr(node, key, None)
