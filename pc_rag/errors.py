"""The one error type pc-rag raises for bad input, with where it happened."""

from __future__ import annotations


class PromptCacheError(ValueError):
    """Bad schema, prompt, argument or cache state.

    The message always says what is wrong and where. Errors that come from PML text carry the
    1-based ``line`` and ``column`` of the offending character (``None`` when not from text); an
    error in one argument of a call names it in ``param`` (``"temperature"``, ``"stop"``; a
    server reports it as OpenAI's ``param``).
    """

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None, param: str | None = None) -> None:
        self.line = line
        self.column = column
        self.param = param
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(message + where)


class ContextWindowExceeded(PromptCacheError):
    """A prompt (or a document) needs more positions than the model's context window: shorten it
    (fewer documents, a shorter history; a document split in chunks). A server answers 400 with
    OpenAI's ``context_length_exceeded`` code; the LangChain adapters raise it as LangChain's
    ``ContextOverflowError`` too."""


class UnknownModule(PromptCacheError):
    """A module reference names a module its schema does not hold (never added, or deleted since the
    reference was made). A server answers 404, as for a document that does not exist."""

    def __init__(self, message: str, *, schema: str, name: str) -> None:
        super().__init__(message)
        self.schema, self.name = schema, name


class QueueFull(PromptCacheError):
    """The scheduler's queue is full (``max_queued`` requests wait): retry later. A server answers 429."""


class ServingFailed(PromptCacheError):
    """A valid request the engine could not serve: the step serving it failed, or the engine's
    scheduler is closed (``unavailable``). Not the caller's input, so trying again may succeed; a
    server answers 500 (503 when unavailable), never 400. A ``PromptCacheError``, so code that
    catches those goes on catching it."""

    def __init__(self, message: str, *, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable
