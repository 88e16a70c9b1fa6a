"""Server-sent events: `data: {json}` chunks ending in `data: [DONE]`, and the bookkeeping that
turns cumulative engine outputs into deltas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.entrypoints.errors import APIError
from pagedllm.entrypoints.serving import Job

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_stream(job: Job, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """`chunks` as SSE. An engine failure mid-stream becomes an error chunk (the status line
    was sent already); a client that goes away cancels this generator, which aborts the job
    at once so its blocks are free within one engine step."""
    completed = False
    try:
        async for chunk in chunks:
            yield sse(chunk)
        yield DONE
        completed = True
    except APIError as exc:
        yield sse(exc.body())
        yield DONE
    finally:
        if not completed:
            job.abort()


class Deltas:
    """What has been sent of each completion (keyed by any hashable), so that each cumulative
    output yields only its unsent text and tokens, and each completion finishes exactly once
    (with n > 1 a finished completion rides along in the outputs of its unfinished siblings)."""

    def __init__(self) -> None:
        self._text: dict[Any, int] = {}
        self._tokens: dict[Any, int] = {}
        self._finished: set[Any] = set()
        self.num_tokens = 0  # tokens sent in all, for `usage`

    def first(self, key: Any) -> bool:
        return key not in self._text

    def take(self, completion, key: Any) -> tuple[str, int, int] | None:
        """(text delta, its start in the text, first unsent token), marked as sent; None while
        there is nothing to send (no text yet, e.g. half a UTF-8 character, no logprobs due and
        not finished) and once its finish was sent."""
        if key in self._finished:
            return None
        text_start = self._text.get(key, 0)
        token_start = self._tokens.get(key, 0)
        delta = completion.text[text_start:]
        new_tokens = len(completion.token_ids) - token_start
        logprobs_due = new_tokens and completion.logprobs is not None
        if not delta and completion.finish_reason is None and not logprobs_due:
            return None
        if completion.finish_reason is not None:
            self._finished.add(key)
        self._text[key] = len(completion.text)
        self._tokens[key] = len(completion.token_ids)
        self.num_tokens += new_tokens
        return delta, text_start, token_start
