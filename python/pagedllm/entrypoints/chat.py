"""Chat messages -> one prompt string, for `/v1/chat/completions` and `LLM.chat`.

The template is, first match wins: the one given (`--chat-template FILE`, `chat_template=`), the
checkpoint's own (`chat_template` in tokenizer_config.json, or the transformers tokenizer's), else
`DEFAULT_CHAT_TEMPLATE`. Templates are Jinja2 (sandboxed), rendered with `messages`,
`add_generation_prompt=True`, `bos_token` and `eos_token`, as Hugging Face renders them.
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
# and the assistant's header to end with, so the model continues as the assistant.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
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
    template = getattr(inner, "chat_template", None)
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


def normalize_messages(messages: Any) -> list[dict[str, str]]:
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
        out.append({"role": role, "content": _content_text(message.get("content"), where)})
    return out


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def _special_text(tokenizer: Any, token_id: int | None) -> str:
    if tokenizer is None or token_id is None:
        return ""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def render_chat(
    messages: Sequence[dict], tokenizer: Any = None, chat_template: str | None = None
) -> str:
    """The prompt text of one conversation (see the module docstring for the template used)."""
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
