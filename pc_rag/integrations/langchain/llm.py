"""``PromptCacheLLM``: pc-rag as a LangChain ``BaseLLM`` (text in, text out)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from ...callers import StreamingGeneration, gather_or_cancel
from ...decode.request import Generation as EngineGeneration
from .._shared import (
    as_prompt,
    generation_info,
    iterate_in_thread,
)
from .base import EngineParams, token_usage
from .errors import langchain_errors


class PromptCacheLLM(EngineParams, BaseLLM):
    """A LangChain LLM (text in, text out) served by Prompt Cache.

    ``PromptCacheLLM(engine=engine, max_new_tokens=128)``. The prompt is used as given, like
    ``HuggingFacePipeline`` does (no chat template; use :class:`ChatPromptCache` for that).
    Reuse statistics are in each generation's ``generation_info``.
    """

    @property
    def _llm_type(self) -> str:
        return "pc-rag"

    @langchain_errors
    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations: list[list[Generation]] = []
        if self.streaming:
            for prompt in prompts:
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text = "".join(c.text for c in chunks)
                generations.append([Generation(text=text, generation_info=chunks[-1].generation_info)])
            return self._result(generations)
        # several prompts (LLM.batch / generate) decode together: one forward pass per step for all
        texts = [as_prompt(p, self.pml) for p in prompts]
        return self._results(self.engine.generate_batch(texts, **self._engine_kwargs(stop, kwargs)))

    def _results(self, results: list[EngineGeneration]) -> LLMResult:
        return self._result([[Generation(text=r.text, generation_info=generation_info(r, self.engine))] for r in results])

    def _result(self, generations: list[list[Generation]]) -> LLMResult:
        usage = token_usage([g[0].generation_info or {} for g in generations])
        return LLMResult(generations=generations, llm_output={"model_name": self.model_name, "token_usage": usage})

    @langchain_errors
    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        stream: StreamingGeneration = self.engine.stream(as_prompt(prompt, self.pml), **self._engine_kwargs(stop, kwargs))
        for text in stream:
            chunk = GenerationChunk(text=text)
            if run_manager is not None:
                run_manager.on_llm_new_token(text, chunk=chunk)
            yield chunk
        assert stream.result is not None
        yield GenerationChunk(text="", generation_info=generation_info(stream.result, self.engine))

    @langchain_errors
    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        """:meth:`_generate` for asyncio: each prompt waits on the engine's scheduler
        (``engine.agenerate``), so the event loop never waits on a forward pass, concurrent calls
        are batched, and a cancelled call frees its rows."""
        if self.streaming:
            generations: list[list[Generation]] = []
            for prompt in prompts:
                chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
                generations.append([Generation(text="".join(c.text for c in chunks), generation_info=chunks[-1].generation_info)])
            return self._result(generations)
        params = self._engine_kwargs(stop, kwargs)
        return self._results(list(await gather_or_cancel(*(self.engine.agenerate(as_prompt(p, self.pml), **params) for p in prompts))))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Pieces as they are decoded, by a worker thread; the loop stays free between them."""
        async for chunk in iterate_in_thread(self._stream(prompt, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
