"""A request's prompts as checked token ids (rendered and tokenized off the event loop, in one
tokenizer thread, unless the request carries them in `prompt_token_ids`), and vLLM's
`/tokenize` and `/detokenize`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedllm.entrypoints.async_engine import AsyncEngine
from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.protocol import DetokenizeRequest, TokenizeRequest
from pagedllm.entrypoints.rendering import Prompt, Renderer


class Prompts:
    """`check_model`: the server's 404 for a model it does not serve."""

    def __init__(self, engine: AsyncEngine, renderer: Renderer, check_model: Callable) -> None:
        self.engine = engine
        self.renderer = renderer
        self.check_model = check_model
        # tokenizing (and rendering chat templates) can take milliseconds for a long prompt:
        # one thread keeps it off the event loop, in arrival order
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def in_tokenizer_thread(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def completion(
        self,
        raw: Sequence[str | list[int]],
        truncate: int | None = None,
        token_ids: list[list[int]] | None = None,
    ) -> list[Prompt]:
        """Completion prompts (text or token ids), tokenized (or their `token_ids` taken in
        their place), truncated to their last `truncate` tokens (`truncate_prompt_tokens`) and
        checked."""
        if token_ids is not None and len(token_ids) != len(raw):
            raise APIError(
                400,
                f"prompt_token_ids has {len(token_ids)} lists for {len(raw)} prompts",
                param="prompt_token_ids",
            )
        given = token_ids or [None] * len(raw)
        return await self.in_tokenizer_thread(
            lambda: [
                self._prompt(p, i, "prompt", truncate, ids)
                for i, (p, ids) in enumerate(zip(raw, given))
            ]
        )

    async def chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        truncate: int | None = None,
        token_ids: list[int] | None = None,
    ) -> Prompt:
        """A conversation rendered with the chat template, tokenized (or its `token_ids` taken in
        its place: a router rendered it already), truncated and checked."""
        if token_ids is not None:
            return await self.in_tokenizer_thread(
                lambda: self._prompt(token_ids, 0, "messages", truncate)
            )
        return await self.in_tokenizer_thread(
            lambda: self._prompt(
                self.renderer.render(
                    messages, tools=tools, chat_template_kwargs=chat_template_kwargs
                ),
                0,
                "messages",
                truncate,
            )
        )

    def _tokenizer(self, what: str):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer", param=what)
        return tokenizer

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize` (no length check: `count` and `max_model_len` tell the caller)."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None and body.add_special_tokens is not None:
            raise APIError(
                400,
                "add_special_tokens applies to prompt; messages are tokenized as "
                "/v1/chat/completions tokenizes them",
                param="add_special_tokens",
            )
        tokenizer = self._tokenizer("tokenize")
        renderer = self.renderer

        def encode() -> list[int]:
            if body.messages is not None:
                messages = [m.model_dump() for m in body.messages]
                tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
                text = renderer.render(
                    messages, tools=tools, chat_template_kwargs=body.chat_template_kwargs
                )
                return renderer.encode_chat(text)
            special = body.add_special_tokens is not False
            return list(tokenizer.encode(body.prompt, add_special_tokens=special))

        ids = await self.in_tokenizer_thread(encode)
        answer: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            decode = self.engine.engine.output_processor.decode_one
            answer["token_strs"] = await self.in_tokenizer_thread(lambda: list(map(decode, ids)))
        return answer

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's `/detokenize`: the text of `tokens` (special tokens kept)."""
        self.check_model(body.model)
        tokenizer = self._tokenizer("detokenize")
        if body.tokens:
            self._check_ids(body.tokens, 0, "tokens")
        text = await self.in_tokenizer_thread(
            lambda: tokenizer.decode(body.tokens, skip_special_tokens=False)
        )
        return {"prompt": text}

    async def decode(self, prompts: list[Prompt], skip_special_tokens: bool) -> list[str]:
        """The text of each prompt (token-id prompts decoded as the output is), for `echo`."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None and any(p.text is None for p in prompts):
            raise APIError(400, "echo of a token-id prompt needs a tokenizer", param="echo")

        def text(prompt: Prompt) -> str:
            if prompt.text is not None:
                return prompt.text
            return tokenizer.decode(prompt.ids, skip_special_tokens=skip_special_tokens)

        return await self.in_tokenizer_thread(lambda: [text(p) for p in prompts])

    def _prompt(
        self,
        prompt: str | list[int],
        index: int,
        what: str,
        truncate: int | None = None,
        token_ids: list[int] | None = None,
    ) -> Prompt:
        """Checks sizes first, before any per-token work: a text whose length alone shows it
        cannot fit is never tokenized (unless it is to be truncated), a token-id list over the
        limit never range-checked. `truncate`: the engine's `truncate_prompt_tokens` rule.
        `token_ids`: a text prompt's ids, given (checked as a token-id prompt's)."""
        inputs = self.engine.engine.inputs
        text = prompt if isinstance(prompt, str) else None
        if token_ids is None and text is not None:
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise APIError(400, f"{what}: text prompts need a tokenizer", param=what)
            if truncate is None:
                at_least = inputs.min_prompt_tokens(text)
                size = f"{len(text)} characters, so at least {at_least} tokens"
                self._check_length(at_least, index, what, size)
            render = self.renderer
            token_ids = render.encode_chat(text) if what == "messages" else render.encode(text)
        elif token_ids is None:
            token_ids = prompt
        result = Prompt(text, inputs.truncate(list(token_ids), truncate))
        self._check_length(len(result.ids), index, what)
        self._check_ids(result.ids, index, what)
        return result

    def _check_length(
        self, num_tokens: int, index: int, what: str, size: str | None = None
    ) -> None:
        limit = self.engine.max_model_len
        if num_tokens >= limit:
            raise APIError(
                400,
                f"{what}[{index}] has {size or f'{num_tokens} tokens'}; max_model_len is "
                f"{limit}, which must leave room for at least one generated token",
                param=what,
            )

    def check_max_tokens(self, prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
        """A `max_tokens` the client asked for must fit the context with every prompt (OpenAI's
        and vLLM's 400); unset, generation simply stops at max_model_len."""
        if max_tokens is None:
            return
        limit = self.engine.max_model_len
        longest = max(len(p.ids) for p in prompts)
        if max_tokens > limit - longest:
            prompt = "the prompt" if len(prompts) == 1 else "the longest prompt"
            raise APIError(
                400,
                f"{param}={max_tokens} is too large: max_model_len is {limit} tokens and "
                f"{prompt} has {longest}, so at most {limit - longest} can be generated",
                param=param,
            )

    def _check_ids(self, ids: list[int], index: int, what: str) -> None:
        if not ids:
            raise APIError(400, f"{what}[{index}] is empty", param=what)
        vocab = self.engine.engine.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:  # C-level passes; locate only if bad
            i, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise APIError(
                400,
                f"{what}[{index}]: token id {token} at position {i} is outside the "
                f"vocabulary [0, {vocab})",
                param=what,
            )
