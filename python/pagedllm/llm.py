"""`LLM`: offline batched generation (vLLM's `LLM.generate`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from pagedllm.config import DEFAULT_MODEL, EngineArgs
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.engine.batch import generate_batch
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling import build_engine
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class Backend(Protocol):
    """What `LLM` runs its batches on, chosen once when it is built (`_backend`): one engine in
    this process (`EngineBackend`) or N replica processes behind the router core
    (`router.offline.DataParallelEngines`)."""

    args: EngineArgs
    engine: LLMEngine | None  # the engine in this process; None: they run in other processes

    def get_tokenizer(self): ...

    def generate(
        self,
        request_ids: list[str],
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None],
        on_done: Callable[[int], object] | None = None,
    ) -> list[RequestOutput]:
        """Every request run to completion, their final outputs in order (`on_done(n)`: n more
        finished)."""
        ...

    def close(self) -> None: ...


class EngineBackend:
    """One engine in this process."""

    def __init__(self, args: EngineArgs) -> None:
        self.engine = build_engine(args)  # a PoolingEngine with runner='pooling'
        self.args = self.engine.args

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, request_ids, prompts, params, priorities, loras, on_done=None):
        return generate_batch(self.engine, request_ids, prompts, params, priorities, loras, on_done)

    def close(self) -> None:
        """Nothing to stop: the engine's executor stops with it (or at exit)."""


def _backend(args: EngineArgs) -> Backend:
    if args.data_parallel_size > 1:
        from pagedllm.router.offline import DataParallelEngines

        return DataParallelEngines(args)
    return EngineBackend(args)


class LLM:
    """Build an engine from a local Hugging Face checkpoint folder (or the built-in
    `pagedllm/tiny-random`) and generate for batches of prompts.

    Every `EngineArgs` field is accepted as a keyword (block_size, num_gpu_blocks, scheduling,
    policy, preemption_mode, enable_prefix_caching, max_num_seqs, ...).

    `data_parallel_size=N` runs N engine processes (`pagedllm.router.offline`): each prompt
    goes to the replica the cache-aware router picks, outputs come back in order; `close()`
    (or deleting the `LLM`) stops them.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        self._init(EngineArgs.from_kwargs(model=model, **engine_kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._init(args)
        return llm

    def _init(self, args: EngineArgs) -> None:
        self._ids = itertools.count()
        self.backend = _backend(args)
        self.args = self.backend.args
        self.engine = self.backend.engine

    @property
    def replicas(self):
        """The data-parallel replica set (`router.offline.DataParallelEngines`: its router, its
        processes' pids), None with one engine in this process."""
        return self.backend if self.engine is None else None

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine behind this `LLM` (vLLM's name; `engine` is the same object)."""
        if self.engine is None:
            raise AttributeError(
                f"this LLM runs {self.args.data_parallel_size} data-parallel replicas in "
                "processes of their own; there is no engine in this process"
            )
        return self.engine

    def get_tokenizer(self):
        return self.backend.get_tokenizer()

    def close(self) -> None:
        """Stops the data-parallel replicas (nothing to do for one in-process engine)."""
        self.backend.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in order.

        `prompts`: a string, a `{"prompt_token_ids": [...]}` dict, or a list of them.
        `sampling_params`: one for all prompts or one per prompt. `priority`: one per prompt
        (lower = more urgent; used with policy="priority"). `lora_request`: the LoRA adapter of
        every prompt, or one per prompt (None: the base model); needs `enable_lora=True`.
        """
        prompt_list = _as_prompt_list(prompts)
        count = len(prompt_list)
        params = _per_prompt("sampling_params", sampling_params, count, SamplingParams())
        priorities = _per_prompt("priority", priority, count, 0, broadcast=False)
        loras = _per_prompt("lora_request", lora_request, count, None)
        request_ids = [f"{next(self._ids)}" for _ in prompt_list]
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        try:
            return self.backend.generate(
                request_ids,
                prompt_list,
                params,
                priorities,
                loras,
                on_done=bar.update if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ):
        """Beam search of every prompt (vLLM's `LLM.beam_search`): one `BeamSearchOutput` per
        prompt, its `params.beam_width` best beams first (`engine/beam_search.py`: the
        scoring, and how beams share the KV cache's blocks copy-on-write). Every beam of every
        prompt runs in the same engine steps; with data-parallel replicas each prompt's whole
        search runs on the replica the router picks for it (its beams fork there)."""
        from pagedllm.engine.beam_search import beam_outputs, run_beam_search

        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt("lora_request", lora_request, len(prompt_list), None)
        request_ids = [f"{next(self._ids)}" for _ in prompt_list]
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        try:
            on_done = bar.update if bar is not None else None
            if self.engine is None:  # a beam request is one request to a replica's engine
                count = len(prompt_list)
                outputs = self.backend.generate(
                    request_ids, prompt_list, [params] * count, [0] * count, loras, on_done
                )
                return beam_outputs(self.get_tokenizer(), outputs)
            return run_beam_search(self.engine, request_ids, prompt_list, params, loras, on_done)
        finally:
            if bar is not None:
                bar.close()

    def embed(self, prompts: PromptType | Sequence[PromptType], *, dimensions: int | None = None):
        """The embedding of every prompt, in order (vLLM's `LLM.embed`; needs
        `runner="pooling"`): `EmbeddingRequestOutput`s whose `outputs.embedding` is pooled as
        the checkpoint's sentence-transformers files say (`pagedllm.pooling`). `dimensions`: a
        Matryoshka model's first values, normalized again."""
        from pagedllm.pooling import PoolingParams
        from pagedllm.pooling.offline import embed, pooling_engine

        prompt_list = _as_prompt_list(prompts)
        ids = [f"{next(self._ids)}" for _ in prompt_list]
        return embed(pooling_engine(self.engine), ids, prompt_list, PoolingParams(dimensions))

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        chat_template: str | None = None,
    ):
        """The relevance of each (query, document) pair (vLLM's `LLM.score`): one query
        against every document, or pair by pair; `ScoringRequestOutput`s whose `outputs.score`
        is a classifier's sigmoid, or an embedding model's cosine similarity. `chat_template`:
        a classifier's score template (e.g. Qwen3-Reranker's; `pagedllm.pooling.score_template`)."""
        from pagedllm.pooling.offline import pooling_engine, score

        engine, new_id = pooling_engine(self.engine), lambda: f"{next(self._ids)}"
        return score(engine, new_id, data_1, data_2, chat_template=chat_template)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        tool_parser: str | None = None,
        parallel_tool_calls: bool = True,
        reasoning_parser: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of OpenAI-style messages:
        `role`, `content`, and an assistant's `tool_calls` / a tool message's `tool_call_id`)
        or to each of a list of conversations; one RequestOutput per conversation
        (`lora_request`: as in `generate`).

        Messages are rendered as the server renders them (`pagedllm.chat.template`):
        `chat_template` (a Jinja2 template, or a file holding one), else the checkpoint's own,
        else `DEFAULT_CHAT_TEMPLATE`; with `tools` (OpenAI function tools) and
        `chat_template_kwargs` (e.g. `{"enable_thinking": False}`).

        Tools and reasoning as on the server (`pagedllm.chat.tools`): `tool_choice`
        "none", "required", `{"type": "function", "function": {"name": ...}}` or "auto" (the
        default when `tool_parser`, "hermes" or "llama3_json", is given; else "none").
        With calls to parse or a `reasoning_parser` ("qwen3", "deepseek_r1"), each completion
        also has `reasoning`, `content` and `tool_calls` (see `CompletionOutput`).
        """
        from pagedllm.chat.template import (
            checkpoint_chat_template,
            encode_chat,
            load_chat_template,
            render_chat,
        )
        from pagedllm.chat.tools import ChatOptions, finish_reason, plan_chat

        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)
            if not conversations:
                raise ValueError("messages is empty")
        template = load_chat_template(chat_template)
        tokenizer = self.get_tokenizer()
        if template is None:
            template = checkpoint_chat_template(tokenizer, self.args.tokenizer or self.args.model)
        if tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer (the engine has none)")
        options = ChatOptions(
            tool_call_parser=tool_parser,
            enable_auto_tool_choice=tool_parser is not None,
            reasoning_parser=reasoning_parser,
        )
        if tool_choice is None:
            tool_choice = "auto" if tools and tool_parser else "none"
        params = _per_prompt(
            "sampling_params", sampling_params, len(conversations), SamplingParams()
        )
        plans = [
            plan_chat(
                options,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                constraint=getattr(p, "structured_outputs", None),
            )
            for p in params
        ]
        params = [
            dataclasses.replace(p, structured_outputs=plan.constraint)
            if isinstance(p, SamplingParams) and plan.constraint is not p.structured_outputs
            else p
            for p, plan in zip(params, plans)
        ]
        prompts = []
        for conversation in conversations:
            text = render_chat(
                conversation,
                tokenizer,
                template,
                tools=plans[0].tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": encode_chat(tokenizer, text), "prompt": text})
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)
        for output, plan in zip(outputs, plans):
            if not plan.splits:
                continue
            for completion in output.outputs:
                message = plan.message(completion.text)
                completion.reasoning = message.reasoning
                completion.content = message.content
                completion.tool_calls = message.tool_calls
                completion.finish_reason = finish_reason(
                    bool(message.tool_calls), completion.finish_reason
                )
        return outputs


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts is empty")
    for i, prompt in enumerate(prompt_list):
        if not isinstance(prompt, (str, dict)):
            raise ValueError(
                f"prompts[{i}] must be a string or a {{'prompt_token_ids': [...]}} "
                f"dict, got {type(prompt).__name__}"
            )
    return prompt_list


def _per_prompt(name: str, value, count: int, default, *, broadcast: bool = True) -> list:
    if value is None:
        return [default] * count
    if broadcast and not isinstance(value, (list, tuple)):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} prompts")
    return values


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
