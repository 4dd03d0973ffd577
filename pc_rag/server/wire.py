"""OpenAI's wire format: request bodies read into engine calls, replies written back.

Bodies are validated by pydantic in strict JSON mode (``"1"`` is not a number), so a wrong type
is a 400 that names the field. Fields this server does not know are ignored and logged by name,
as OpenAI-compatible servers do, since clients send many; known fields with values it cannot
honour (``n`` other than 1, penalties, log-probabilities, a logit bias) are a 400 that says so.

Nothing here touches the model: :func:`chat_call` and :func:`completion_call` turn a body into
the prompt (plain text: nothing a client sends becomes PML) and ``generate`` keywords, and the
``*_response``/``*_chunk`` functions turn a :class:`~pc_rag.Generation` into JSON.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..decode.logprobs import MAX_TOP_LOGPROBS, chat_logprobs, completion_logprobs
from ..decode.request import Generation
from ..decode.sampling import SEED_MAX, SEED_MIN
from ..errors import ContextWindowExceeded, PromptCacheError, QueueFull, ServingFailed, UnknownModule
from ..prompt.schemas import response_format_schema
from ..prompt.tools import call_id, call_schema, parse_calls, resolve_tool_choice

logger = logging.getLogger(__name__)

MAX_CHOICES = 16  # choices per prompt (n): each is a row of the scheduler and a slot of its key's quota


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# the engine's names of its arguments (PromptCacheError.param) where the wire's differ
_WIRE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format"}


def bad_request(exc: PromptCacheError, *, chat: bool) -> ApiError:
    """A request the engine refused, as OpenAI's 400: ``param`` names the field at fault as the
    request spelled it, and a prompt past the context window carries OpenAI's
    ``context_length_exceeded`` code (on which ChatOpenAI raises LangChain's ContextOverflowError)."""
    param = exc.param
    if param == "prompt" and chat:
        param = "messages"
    elif param == "logprobs" and chat:
        param = "top_logprobs"
    else:
        param = _WIRE_NAMES.get(param, param) if param is not None else None
    code = "context_length_exceeded" if isinstance(exc, ContextWindowExceeded) else None
    return ApiError(400, str(exc), param=param, code=code)


RETRY_AFTER_S = 1  # what a 429 tells the client to wait (the openai SDK and ChatOpenAI retry after it)


def rate_limited(message: str, code: str, retry_after_s: int = RETRY_AFTER_S) -> ApiError:
    """429 with ``Retry-After``: the server is full (``queue_full``) or the key is at one of its
    bounds (``rate_limit_exceeded``); the request was not started."""
    return ApiError(429, message, kind="rate_limit_error", code=code, headers={"Retry-After": str(retry_after_s)})


def not_found(what: str) -> ApiError:
    """The one answer for a collection or document that does not exist *or* that the caller's key
    may not see: the two are indistinguishable from outside."""
    return ApiError(404, f"{what} not found", code="not_found")


# -- request bodies ------------------------------------------------------------------------------
class RequestBody(BaseModel):
    """A request body read in strict JSON mode; fields it does not name are kept (and logged by name)."""

    model_config = ConfigDict(extra="allow", strict=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCall(RequestBody):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's format)


class ToolCall(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Sampling(RequestBody):
    """What chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # beyond OpenAI's fields, with vLLM's names (clients pass them as extra_body)
    top_k: Annotated[int, Field(ge=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    no_repeat_ngram_size: Annotated[int, Field(ge=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None
    # pc-rag's own: documents by id, placed at the start of the last user message by the server
    documents: list[str] | None = None
    collection: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], Field(min_length=1)]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def read_body(model: type[RequestBody], raw: bytes) -> Any:
    """``raw`` validated as ``model``: a 400 that names the first wrong field otherwise."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {error['msg']}") from None
        if error["type"] == "model_type" and not error["loc"]:
            raise ApiError(400, "the body must be a JSON object") from None
        where, says = _deepest_error(exc.errors())
        raise ApiError(400, f"{where or 'body'}: {says}", param=where or None) from None
    unknown = body.unknown_fields()
    if unknown:
        logger.info("ignored fields this server does not know: %s", ", ".join(unknown[:20]))
    return body


def _deepest_error(errors: list[Any]) -> tuple[str, str]:
    """Where and what, for the deepest of pydantic's errors: a field that may take several types
    (a message's content: text or a list of text parts) fails in every branch, and the deepest
    failure says the most (an image part: "messages.0.content.0.type: Input should be 'text',
    got 'image_url'", not "content.str: Input should be a valid string"). The branches' tags
    (``str``, ``list[TextPart]``) are left out of the path; branches failing at the same place
    are joined with "or"."""

    def path(error: Any) -> tuple[Any, ...]:
        # a branch's tag is a type's name: a string no field has ("str", "list[TextPart]", "int")
        return tuple(part for part in error["loc"] if not (isinstance(part, str) and (part in _BRANCH_TAGS or "[" in part)))

    deepest = max(len(path(error)) for error in errors)
    at = next(path(error) for error in errors if len(path(error)) == deepest)
    here = [error for error in errors if path(error) == at]
    said = list(dict.fromkeys(error["msg"] for error in here))
    lead = "Input should be "
    if len(said) > 1 and all(s.startswith(lead) for s in said):  # "Input should be a valid string or a valid array"
        said = [said[0]] + [s[len(lead):] for s in said[1:]]
    value = here[0].get("input")
    shown = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else ""
    got = f", got {shown}" if shown and len(shown) <= 80 and here[0]["type"] != "missing" else ""
    return ".".join(str(part) for part in at), " or ".join(said) + got


_BRANCH_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "function-after", "function-before"})


# -- requests as engine calls --------------------------------------------------------------------
@dataclass
class Call:
    """One generation the engine runs: plain-text prompt, ``generate`` keywords, tools in force,
    and the tokens of the documents the prompt imports (its module references stand for them)."""

    prompt: str
    params: dict[str, Any]
    tools: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    imported_tokens: int = 0


def choices(call: Call, n: int) -> list[Call]:
    """``n`` generations of one prompt (the body's ``n``). With a seed, choice ``i`` samples with
    seed + i: the choices differ from each other, and the whole reply is reproducible."""
    seed = call.params.get("seed")
    if seed is None or n == 1:
        return [call] * n
    span = SEED_MAX - SEED_MIN + 1
    return [replace(call, params={**call.params, "seed": (seed + i - SEED_MIN) % span + SEED_MIN}) for i in range(n)]


def _logprobs(body: _Sampling) -> int | None:
    """How many alternatives each token's log-probability comes with (None: no log-probabilities).
    Chat asks with ``logprobs: true`` and ``top_logprobs``; text completions with ``logprobs: k``."""
    top = getattr(body, "top_logprobs", None)
    if isinstance(body, ChatRequest):
        if body.logprobs is not None and not isinstance(body.logprobs, bool):
            raise ApiError(400, f"logprobs of a chat completion is true or false, got {body.logprobs!r}; "
                                "top_logprobs gives the alternatives", param="logprobs")
        if top is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        wanted = (top or 0) if body.logprobs else None
    else:
        wanted = None if body.logprobs is None or body.logprobs is False else 0 if body.logprobs is True else body.logprobs
    if wanted is None:
        return None
    if not 0 <= wanted <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if isinstance(body, ChatRequest) else "logprobs"
        raise ApiError(400, f"{name} must be from 0 to {MAX_TOP_LOGPROBS}, got {wanted}", param=name)
    return wanted


def _sampling(body: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    # max_tokens with OpenAI's meaning: refused up front when the prompt leaves less room in the window
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                              "top_k": body.top_k, "stop": body.stop, "seed": body.seed}
    logprobs = _logprobs(body)
    if logprobs is not None:
        params["logprobs"] = logprobs
    for name, engine_name in (("repetition_penalty", "repetition_penalty"), ("no_repeat_ngram_size", "no_repeat_ngram_size"),
                              ("min_tokens", "min_new_tokens"), ("presence_penalty", "presence_penalty"),
                              ("frequency_penalty", "frequency_penalty"), ("logit_bias", "logit_bias")):
        value = getattr(body, name)
        if value is not None:
            params[engine_name] = value
    return params


def _text(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _turn(message: Message, index: int) -> dict[str, Any]:
    """A message as a chat-template turn (``developer`` is OpenAI's newer name for ``system``)."""
    turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": _text(message.content)}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                raise ApiError(400, f"messages.{index}.tool_calls: arguments of {call.function.name!r} are not JSON",
                               param=f"messages.{index}.tool_calls") from None
            calls.append({"type": "function", "id": call.id, "function": {"name": call.function.name, "arguments": arguments}})
        turn["tool_calls"] = calls
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None and message.role == "tool":
        turn["name"] = message.name
    return turn


def chat_call(body: ChatRequest, render: Any, references: Sequence[str] = (), imported_tokens: int = 0) -> Call:
    """The engine call of a chat completion; ``render`` is the engine's ``render_chat``;
    ``references`` (module references of the documents the body names, ``imported_tokens`` in
    all) open the last user message."""
    turns = [_turn(message, i) for i, message in enumerate(body.messages)]
    if references:
        users = [i for i, turn in enumerate(turns) if turn["role"] == "user"]
        if not users:
            raise ApiError(400, "documents are placed in the last user message, and there is none", param="documents")
        turns[users[-1]]["content"] = "".join(references) + turns[users[-1]]["content"]
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    try:
        choice = resolve_tool_choice(body.tool_choice, tools)
        params = _sampling(body, body.max_completion_tokens or body.max_tokens)
        if choice == "none":
            tools = []
        elif choice != "auto":
            params["json_schema"] = call_schema(tools, None if choice == "required" else choice)
        if body.response_format is not None and body.response_format.get("type") != "text":
            if "json_schema" in params:
                raise ApiError(400, "give a forced tool_choice or a response_format, not both", param="response_format")
            params["json_schema"] = response_format_schema(body.response_format)
    except PromptCacheError as exc:
        raise ApiError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc) else "response_format") from None
    prompt = render(turns, tools or None)
    include = body.stream_options is not None and body.stream_options.include_usage
    return Call(prompt, params, tools, body.stream, include, imported_tokens)


def completion_calls(body: CompletionRequest) -> list[Call]:
    """The engine calls of a text completion: one per prompt (a list gives one choice each)."""
    for name, given in (("echo", body.echo), ("suffix", body.suffix), ("best_of", (body.best_of or 1) != 1)):
        if given:
            raise ApiError(400, f"{name} is not supported (pc-rag serves no echo, suffix or best_of)", param=name)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if body.stream and len(prompts) != 1:
        raise ApiError(400, "a streamed completion takes one prompt", param="prompt")
    include = body.stream_options is not None and body.stream_options.include_usage
    return [choice for prompt in prompts for choice in choices(Call(prompt, _sampling(body, body.max_tokens), [], body.stream, include), body.n)]


# -- replies -------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(results: Sequence[Generation], n: int = 1) -> dict[str, Any]:
    """Token counts, each prompt's counted once for its ``n`` choices (as OpenAI counts them);
    ``prompt_tokens_details.cached_tokens`` is the prompt tokens whose KV was reused (module
    tokens), as OpenAI and vLLM report prefix-cache hits."""
    prompts = results[::n]
    prompt = sum(r.stats.cached_tokens + r.stats.computed_tokens for r in prompts)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_tokens for r in prompts)}}


def reply_message(result: Generation, tools: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], str]:
    """The assistant message and finish reason: ``tool_calls`` when the reply is a call to a tool in force."""
    calls = parse_calls(result.text, tools) if tools else []
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id(), "type": "function", "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
            for call in calls]}, "tool_calls"
    return {"role": "assistant", "content": result.text}, result.finish_reason


def chat_response(request_id: str, model: str, results: Sequence[Generation], tools: Sequence[Mapping[str, Any]],
                  tokenizer: Any = None) -> dict[str, Any]:
    """A chat completion of one choice per result; ``tokenizer`` names the tokens of the
    log-probabilities, when asked for; ``pc_rag`` holds the first choice's reuse statistics."""
    replies = [(reply_message(result, tools), result) for result in results]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": message, "finish_reason": finish, "logprobs": chat_logprobs(result.logprobs, tokenizer)}
                        for i, ((message, finish), result) in enumerate(replies)],
            "usage": usage(results, len(results)), "pc_rag": results[0].stats.as_dict()}


def completion_response(request_id: str, model: str, results: Sequence[Generation], n: int = 1, tokenizer: Any = None) -> dict[str, Any]:
    """A text completion: ``n`` choices per prompt, in the prompts' order."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": completion_logprobs(r.logprobs, tokenizer)}
                        for i, r in enumerate(results)],
            "usage": usage(results, n)}


def chat_chunk(request_id: str, model: str, delta: dict[str, Any], finish: str | None = None,
               logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}


def completion_chunk(request_id: str, model: str, text: str, finish: str | None = None,
                     logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}]}


def usage_chunk(request_id: str, model: str, kind: str, results: Sequence[Generation]) -> dict[str, Any]:
    """The last chunk of a stream asked for with ``stream_options.include_usage``: no choices, the
    usage of its choices (one prompt's)."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(results, len(results))}


def api_error(exc: BaseException, *, chat: bool = False) -> ApiError:
    """Any failure as the error a client gets (of a chat completion: ``chat``, whose fields are
    named otherwise); anything unexpected is a 500 and logged."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        return rate_limited(str(exc), "queue_full")
    if isinstance(exc, ServingFailed):  # not the client's input: a 5xx, which clients retry
        logger.error("request failed", exc_info=exc)
        if exc.unavailable:
            return ApiError(503, "the server is shutting down", kind="server_error", code="unavailable")
        return ApiError(500, "the engine failed to serve this request; trying again may succeed", kind="server_error")
    if isinstance(exc, UnknownModule):  # a document deleted after the request named it: as if it never existed
        return not_found(f"document {exc.name!r} in collection {exc.schema!r}")
    if isinstance(exc, PromptCacheError):
        return bad_request(exc, chat=chat)
    logger.error("request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error")
