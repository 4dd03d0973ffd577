"""pc-rag's errors as LangChain's model errors, the way ChatOpenAI raises OpenAI's.

A model call that fails raises an error of both kinds: what the engine raised (a
:class:`~pc_rag.PromptCacheError`, with its ``param``, ``line`` and ``column``) and the
``langchain_core.exceptions`` class of that condition, so code written against either catches it:
a chain that trims its history on ``ContextOverflowError`` or backs off on
``ModelRateLimitError`` works with :class:`ChatPromptCache` as it does with ``ChatOpenAI``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelError,
    ModelInvalidRequestError,
    ModelRateLimitError,
)

from ...errors import ContextWindowExceeded, PromptCacheError, QueueFull, ServingFailed

F = TypeVar("F", bound=Callable[..., Any])


class InvalidRequest(PromptCacheError, ModelInvalidRequestError):
    """Bad input to a model call (an argument, a prompt): LangChain's ``ModelInvalidRequestError``."""


class ContextOverflow(ContextWindowExceeded, ContextOverflowError):
    """A prompt past the model's context window: LangChain's ``ContextOverflowError``."""


class RateLimited(QueueFull, ModelRateLimitError):
    """The engine's queue is full (``max_queued``): LangChain's ``ModelRateLimitError`` (retryable)."""


class EngineFailed(ServingFailed, ModelAPIError):
    """The engine could not serve a valid request: LangChain's ``ModelAPIError`` (retryable)."""


# most specific first: each engine error takes the first kind it is an instance of
_AS_LANGCHAIN: tuple[tuple[type[PromptCacheError], type[PromptCacheError]], ...] = (
    (ContextWindowExceeded, ContextOverflow),
    (QueueFull, RateLimited),
    (ServingFailed, EngineFailed),
    (PromptCacheError, InvalidRequest),
)


def as_langchain(error: PromptCacheError) -> PromptCacheError:
    """``error`` retyped as its LangChain kind too: the same message and attributes."""
    if isinstance(error, ModelError):
        return error
    kind = next(langchain for engine, langchain in _AS_LANGCHAIN if isinstance(error, engine))
    retyped = kind(*error.args)  # the message already says where: line and column come back below
    retyped.__dict__.update(error.__dict__)  # as unpickling restores an exception
    return retyped


def langchain_errors(method: F) -> F:
    """``method`` (a function, a generator or a coroutine function) raising each engine error as
    :func:`as_langchain` types it, chained to the original."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(*args: Any, **kwargs: Any) -> Any:
            try:
                return (yield from method(*args, **kwargs))
            except PromptCacheError as error:
                _reraise(error)

        return cast(F, generator)
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            try:
                return await method(*args, **kwargs)
            except PromptCacheError as error:
                _reraise(error)

        return cast(F, coroutine)

    @functools.wraps(method)
    def function(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except PromptCacheError as error:
            _reraise(error)

    return cast(F, function)


def _reraise(error: PromptCacheError) -> NoReturn:
    retyped = as_langchain(error)
    if retyped is error:
        raise error
    raise retyped from error
