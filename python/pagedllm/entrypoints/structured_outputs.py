"""Structured output over HTTP: the chat API's `response_format` and vLLM's `structured_outputs`
extra body (completions and chat) to one `StructuredOutputsParams`, and its compile awaited
before the request is queued, so a bad schema, regex or grammar is a 400 naming the problem
(never a 500) and the engine never sees it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.entrypoints.errors import APIError
from pagedllm.structured_output import StructuredOutputsParams


def constraint_of(body: Any) -> StructuredOutputsParams | None:
    """The request's constraint: `structured_outputs` or `response_format` (one of them)."""
    extra = body.structured_outputs
    response_format = getattr(body, "response_format", None)
    from_format = _from_response_format(response_format) if response_format else None
    if extra is not None and from_format is not None:
        raise APIError(
            400,
            "give either response_format or structured_outputs, not both",
            param="structured_outputs",
        )
    if extra is None:
        return from_format
    try:
        return StructuredOutputsParams(**extra)
    except TypeError:  # a key StructuredOutputsParams does not have
        raise APIError(
            400,
            f"structured_outputs takes the keys json, json_object, regex, choice, grammar; "
            f"got {sorted(extra)}",
            param="structured_outputs",
        ) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="structured_outputs") from None


def _from_response_format(fmt: Any) -> StructuredOutputsParams | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
    if schema is None:
        raise APIError(
            400,
            'response_format of type "json_schema" needs json_schema.schema',
            param="response_format",
        )
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise APIError(400, str(exc), param="response_format") from None


async def check_compiles(manager, constraint: StructuredOutputsParams | None) -> None:
    """Waits (without blocking the event loop) for the constraint to compile; 400 if it does
    not. The compiled grammar is cached, so the engine's own compile finds it ready."""
    if constraint is None:
        return
    try:
        await asyncio.wrap_future(manager.compile(constraint))
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"structured output: {exc}", param="structured_outputs") from None
