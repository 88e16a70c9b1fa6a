"""Chat messages -> one prompt string, for `/v1/chat/completions` and `LLM.chat`.

The template is, first match wins: the one given (`--chat-template FILE`, `chat_template=`), the
checkpoint's own (`chat_template` in tokenizer_config.json, or the transformers tokenizer's), else
`DEFAULT_CHAT_TEMPLATE`. Templates are Jinja2 (sandboxed), rendered with `messages`,
`add_generation_prompt=True`, `bos_token`, `eos_token`, `tools` (None without tools) and the
request's `chat_template_kwargs` (e.g. `enable_thinking`), with Hugging Face's `tojson` filter
and `raise_exception`, as `apply_chat_template` renders them. An assistant message's
`tool_calls` reach the template with their `arguments` parsed into objects (as vLLM passes
them), a tool message keeps its `tool_call_id`, and an assistant's `reasoning` is also given as
`reasoning_content` (the name checkpoint templates read).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

# The built-in model (and any checkpoint without a template) gets this: one block per message,
#   <|role|>
#   content
# and the assistant's header to end with, so the model continues as the assistant. With tools,
# a system block lists them (one JSON object each) and asks for calls in the hermes format,
# which assistant messages' tool_calls are written back in; a tool message's header carries
# the id of the call it answers. (`+%}`: the newline after that tag is kept, trim_blocks
# would drop it.)
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nYou may call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "To call one, reply with <tool_call>\n"
    '{"name": <its name>, "arguments": <its arguments object>}\n</tool_call>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['tool_call_id'] %} {{ message['tool_call_id'] }}{% endif +%}"
    "\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first +%}\n{% endif %}"
    '<tool_call>\n{"name": {{ call["function"]["name"] | tojson }}, '
    '"arguments": {{ call["function"]["arguments"] | tojson }}}\n</tool_call>'
    "{% endfor +%}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# what a template is rendered with besides chat_template_kwargs (which may not replace them)
RESERVED_TEMPLATE_NAMES = frozenset(
    ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
)

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(value: str | None) -> str | None:
    """A template given as a file path (read) or as the template text itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a long template string is not a path
        pass
    if "{" not in value:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja2 template")
    return value


def checkpoint_chat_template(tokenizer: Any, folder: str | None) -> str | None:
    """The checkpoint's own chat template, if it has one."""
    inner = getattr(tokenizer, "_tok", None)
    # a GGUF file's tokenizer carries it; a transformers tokenizer (`_tok`) too
    template = getattr(tokenizer, "chat_template", None) or getattr(inner, "chat_template", None)
    if isinstance(template, str):
        return template
    if folder is None:
        return None
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"{where}.content[{j}]: only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool_calls as templates read them: arguments parsed from their JSON text."""
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] must have function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ValueError(
                    f"{where}.tool_calls[{j}].function.arguments is not JSON: {arguments[:80]!r}"
                ) from None
        out.append(
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks one conversation; ValueError naming `messages[i]...` on a bad message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        normal = {"role": role, "content": _content_text(message.get("content"), where)}
        if message.get("tool_calls") is not None:
            normal["tool_calls"] = _tool_calls(message["tool_calls"], where)
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                normal[key] = message[key]
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning is not None:
            normal["reasoning"] = normal["reasoning_content"] = reasoning
        out.append(normal)
    return out


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Hugging Face's `tojson` (no HTML escaping, unlike Jinja2's own)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise ValueError(message)


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _special_text(tokenizer: Any, token_id: int | None) -> str:
    if tokenizer is None or token_id is None:
        return ""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def render_chat(
    messages: Sequence[dict],
    tokenizer: Any = None,
    chat_template: str | None = None,
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of one conversation (see the module docstring for the template used)."""
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(extra))
    if reserved:
        from pagedllm.chat.tools import ChatRequestError

        raise ChatRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    template = chat_template or DEFAULT_CHAT_TEMPLATE
    try:
        compiled = _compile(template)
    except Exception as exc:  # jinja2's TemplateSyntaxError
        raise ValueError(f"chat template does not compile: {exc}") from exc
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            add_generation_prompt=True,
            bos_token=_special_text(tokenizer, getattr(tokenizer, "bos_token_id", None)),
            eos_token=_special_text(tokenizer, getattr(tokenizer, "eos_token_id", None)),
            tools=tools or None,
            **extra,
        )
    except ValueError:
        raise
    except Exception as exc:  # the template raised (e.g. raise_exception on a bad role order)
        raise ValueError(f"chat template failed on these messages: {exc}") from exc


def encode_chat(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered conversation. Templates usually write `bos_token` themselves and
    `encode` adds BOS too: the doubled BOS at the start is dropped."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
