"""A score template (vLLM's `chat_template` of `LLM.score` and the server's `--chat-template`
for /v1/score and /v1/rerank): one (query, document) pair -> the classifier's prompt text.

The template is Jinja2 (sandboxed), rendered as vLLM renders it, with `messages` =
`[{"role": "query", "content": query}, {"role": "document", "content": document}]` (and
`bos_token` / `eos_token`), e.g. vLLM's `examples/pooling/score/template/qwen3_reranker.jinja`,
which writes Qwen3-Reranker's system prompt, instruction, query and document and ends with the
assistant's turn, where the model answers "yes" or "no". A template's text before the query is
the same for every pair: with last-token pooling it is computed once (the prefix cache).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the environment transformers' apply_chat_template renders in (so does vLLM's)
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def _special_text(tokenizer: Any, name: str) -> str:
    token_id = getattr(tokenizer, name, None)
    if token_id is None:
        return ""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def render_score_prompt(template: str, query: str, document: str, tokenizer: Any = None) -> str:
    """The prompt text of one pair; ValueError naming `chat_template` when the template does
    not compile or fails."""
    try:
        compiled = _compile(template)
    except Exception as exc:  # jinja2's TemplateSyntaxError
        raise ValueError(f"chat_template: the score template does not compile: {exc}") from exc
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    try:
        return compiled.render(
            messages=messages,
            bos_token=_special_text(tokenizer, "bos_token_id"),
            eos_token=_special_text(tokenizer, "eos_token_id"),
        )
    except Exception as exc:  # the template raised on this pair
        raise ValueError(f"chat_template: the score template failed: {exc}") from exc
