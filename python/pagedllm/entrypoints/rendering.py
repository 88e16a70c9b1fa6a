"""A request's prompt as token ids, one way for the server and the router in front of it: the
chat template (given the request's tools, as its plan renders them, and its
`chat_template_kwargs`) and the tokenizer.

A replica's `Renderer` describes itself on its `/load` (`description`: where its tokenizer is,
its chat template, its chat options); the router loads the same one from that description
(`Renderer.load`), renders and tokenizes a request once, hashes those ids for routing and
forwards them in the body's `prompt_token_ids`, which the replica runs in place of rendering
and tokenizing again. The field is part of the public API: a client sending it gets exactly
what a token-id prompt gets (the same length and vocabulary checks), so a forged one can do no
more than `/v1/completions` with token ids already can.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.chat.template import encode_chat, render_chat
from pagedllm.chat.tools import ChatOptions, rendered_tools
from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.protocol import ChatCompletionRequest
from pagedllm.tokenizer import load_tokenizer


@dataclass
class Prompt:
    text: str | None  # None for a token-id prompt
    ids: list[int]


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The request's messages as the template reads them."""
    return [m.model_dump(exclude_none=True) for m in body.messages]


def chat_tools(body: ChatCompletionRequest) -> list[dict]:
    """The request's tools as plain dicts (what `plan_chat` checks)."""
    return [t.model_dump(exclude_none=True) for t in body.tools or ()]


class Renderer:
    """The tokenizer (None: the server was started without one), the chat template and the
    chat options a prompt is rendered with; `source`: where the tokenizer is loaded from, for
    `description`."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        chat_options: ChatOptions,
        source: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.chat_options = chat_options
        self.source = source

    def render(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """The conversation's prompt text; a 400 naming the field for a template failure."""
        try:
            return render_chat(
                messages,
                self.tokenizer,
                self.chat_template,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as exc:
            # a ChatRequestError names its own field
            raise APIError(400, str(exc), param=getattr(exc, "param", "messages")) from None

    def encode_chat(self, text: str) -> list[int]:
        return encode_chat(self.tokenizer, text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """A chat request's prompt ids, as the server renders and tokenizes it (the router's
        path: the server renders with its plan's tools, the same ones)."""
        tools = rendered_tools(self.chat_options, chat_tools(body), body.tool_choice)
        text = self.render(
            chat_messages(body), tools=tools, chat_template_kwargs=body.chat_template_kwargs
        )
        return self.encode_chat(text)

    @property
    def description(self) -> dict | None:
        """What a router needs to build this renderer again (None: no tokenizer to share)."""
        if self.tokenizer is None or self.source is None:
            return None
        return {
            **self.source,
            "chat_template": self.chat_template,
            "chat_options": dataclasses.asdict(self.chat_options),
        }

    @classmethod
    def load(cls, description: dict) -> Renderer:
        """The renderer a replica described (its tokenizer loaded here: the router must see the
        replica's model files, as `serve -dp` and a shared model folder do). ValueError when it
        cannot be loaded."""
        try:
            tokenizer = load_tokenizer(
                description["tokenizer"],
                eos_token_id=description.get("eos_token_id"),
                bos_token_id=description.get("bos_token_id"),
            )
            options = ChatOptions(**description.get("chat_options") or {})
        except (KeyError, TypeError, OSError) as exc:
            raise ValueError(f"the replica's renderer cannot be loaded here: {exc!r}") from exc
        own = ("chat_template", "chat_options")
        source = {k: v for k, v in description.items() if k not in own}
        return cls(tokenizer, description.get("chat_template"), options, source)


def tokenizer_source(name: str, eos_token_id: int | None, bos_token_id: int | None) -> dict:
    """Where a tokenizer is loaded from: a relative folder made absolute (a router started from
    another folder finds it too)."""
    path = Path(name)
    return {
        "tokenizer": str(path.resolve()) if path.exists() else name,
        "eos_token_id": eos_token_id,
        "bos_token_id": bos_token_id,
    }
