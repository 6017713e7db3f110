"""Futures and the SDK's background event loop.

Each SDK operation is written once, as a coroutine. A sync call schedules it on one
background event loop (a daemon thread shared by all clients) and returns an
``APIFuture`` at once; the ``_async`` twin makes the same call at once and returns a
coroutine that gives the future.
``APIFuture`` supports ``.result(timeout)``, ``done()`` and ``await``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from .errors import TimeoutError as TrioTimeoutError

T = TypeVar("T")


class _LoopThread:
    """One event loop in a daemon thread; coroutines from any thread run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pytrio-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_loop: _LoopThread | None = None
_loop_lock = threading.Lock()


def background_loop() -> _LoopThread:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _LoopThread()
        return _loop


# Users' own functions (a custom loss_fn) run in threads of their own. They may block on
# the SDK, whose own blocking work (loading a tokenizer) runs on the loop's default
# executor: sharing that bounded pool (cores + 4 threads) deadlocked once that many
# losses waited on it at once.
_user_threads: concurrent.futures.ThreadPoolExecutor | None = None


async def in_user_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread kept for user code (its context copied, as
    ``asyncio.to_thread`` does)."""
    global _user_threads
    with _loop_lock:
        if _user_threads is None:
            _user_threads = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="pytrio-user")
        pool = _user_threads
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(pool, call)


def _forget_threads_after_fork() -> None:
    """In a forked child only the forking thread lives on: the loop's thread and the
    pool's are gone, and work queued to them waited for ever. The child starts its own on
    first use. (Clients must be made in the child: one made before the fork holds
    connections of the parent's loop.)"""
    global _loop, _loop_lock, _user_threads
    _loop, _loop_lock, _user_threads = None, threading.Lock(), None


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_threads_after_fork)


class APIFuture(Generic[T]):
    """The result of an operation that is still running on the service.

    Example:
        >>> fut = training_client.forward_backward(data, "cross_entropy")
        >>> out = fut.result()          # or: out = await fut
    """

    def __init__(self, future: concurrent.futures.Future[T]):
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        """Block until done; raises the operation's TrioError, or TimeoutError."""
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin one, as pytrio's own TimeoutError is
            if self._future.done():  # done meanwhile, or the operation's own timeout
                return self._future.result()
            raise TrioTimeoutError(f"no result within {timeout} s") from None

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        # Shielded: cancelling the awaiting task (``asyncio.wait_for``'s timeout, a
        # TaskGroup's failing sibling) abandons this wait only. Unshielded, the
        # cancellation reached the operation's own future, whose request had been sent and
        # still ran (its gradient applied at the next step) while every later ``result()``
        # raised CancelledError.
        # A wait abandoned so leaves its copy of the outcome unread: read here, or an
        # operation failing later logs "Future exception was never retrieved".
        inner = asyncio.wrap_future(self._future)
        inner.add_done_callback(_retrieved)
        return asyncio.shield(inner).__await__()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def schedule(coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
    """Run ``coro`` on the background loop; return its future at once."""
    return APIFuture(background_loop().submit(coro))


async def on_background(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on the SDK's loop, from whichever loop the caller runs.

    Transports (an httpx client, say) belong to one event loop; user code may await us
    from its own. Hopping keeps all I/O on the background loop.
    """
    loop = background_loop()
    if asyncio.get_running_loop() is loop.loop:
        return await coro
    return await asyncio.wrap_future(loop.submit(coro))


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the background loop and wait for its value."""
    return background_loop().submit(coro).result()


def sync_twin(async_fn: Callable[..., Awaitable[T]]) -> Callable[..., T]:
    """The blocking version of an async method that returns a value (not a future)."""

    @functools.wraps(async_fn)  # keeps the async method's docstring: same operation
    def method(self, *args, **kwargs):
        return run_sync(async_fn(self, *args, **kwargs))

    method.__name__ = async_fn.__name__.removesuffix("_async")
    return method


def async_twin(sync_fn: Callable[..., APIFuture[T]]) -> Callable[..., Coroutine[Any, Any, APIFuture[T]]]:
    """The ``_async`` version of a future-returning method: ``await`` it for the future.

    The call itself (not the first ``await``) makes the request and takes its place in
    the client's order, as the sync method does: ``create_task(tc.forward_backward_async(..))``
    then ``tc.optim_step()`` steps on that gradient. (An ``async def`` twin took its place
    only when its coroutine first ran, after the step.) An error is raised at the
    ``await``, as from an ``async def``.
    """

    method = _at_call(sync_fn, lambda self, *args, **kwargs: _ready(sync_fn(self, *args, **kwargs)))
    method.__name__ = sync_fn.__name__ + "_async"
    return method


def begun_at_call(body: Callable[..., Awaitable[T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    """An ``_async`` method returning a value whose request must take its place in the
    client's order at the call, as ``async_twin``'s do: ``body`` (a plain function
    returning an awaitable) runs at the call, and the coroutine returned awaits its value.
    (An ``async def`` took its place at its first ``await``:
    ``gather(tc.get_info_async(), tc.optim_step_async())`` counted the step.)"""
    return _at_call(body, lambda self, *args, **kwargs: _awaited(body(self, *args, **kwargs)))


def _at_call(wrapped: Callable[..., Any], start: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    """A method that makes its call at once: ``start(self, ...)`` runs at the call and gives
    the coroutine to await. An error from the call is raised at the ``await``, as from an
    ``async def``."""

    @functools.wraps(wrapped)
    def method(self, *args, **kwargs):
        try:
            awaitable = start(self, *args, **kwargs)
        except Exception as exc:
            awaitable = _raise(exc)
        # named as the call in a "coroutine ... was never awaited" warning (the call was made)
        awaitable.__qualname__ = f"{type(self).__name__}.{method.__name__}"
        return awaitable

    method.calls_at_once = True  # type: ignore[attr-defined]
    if hasattr(inspect, "markcoroutinefunction"):  # Python >= 3.12: inspect calls it a coroutine function
        inspect.markcoroutinefunction(method)
    return method


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def _ready(value: T) -> T:
    return value


async def _raise(exc: Exception) -> Any:
    raise exc
