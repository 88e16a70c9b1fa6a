"""Result types returned by `LLM.generate` and `LLMEngine.step` (vLLM's names).

Pure Python on purpose: importing it must not import torch.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    """A tool call id in OpenAI's format: `call_` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """A function call the model made: `arguments` is the JSON text of its arguments, exactly as
    the model wrote it (OpenAI's `tool_calls[].function.arguments`)."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Logprob:
    """Log-probability of one token. `rank` is 1 for the most likely token of the step."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N ones).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort", or None while running. `stop_reason` is the stop token id or the
    stop string that ended it (None for EOS and the other reasons). `cumulative_logprob` and
    `logprobs` are None unless the request asked for logprobs.

    `LLM.chat` with tools or a reasoning parser also splits `text` as the server's message:
    `reasoning` (the thinking), `content` (the answer's text, None when empty) and `tool_calls`
    (the calls parsed from it; finish_reason is then "tool_calls"). They stay None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (seconds, `time.time()` scale) of a request's life."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # of RequestOutput.num_cached_tokens: the tokens loaded from the KV offload tier (the rest
    # were hits in the device prefix cache)
    num_offloaded_cached_tokens: int = 0
    # the tier they came from: "host" (kv_offloading_backend="native") or "disk"; None when
    # the offload tier loaded none
    offload_tier: str | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at the end of `LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None, repr=False)
    lora_request: Any = None  # the request's LoRARequest (None: the base model)
