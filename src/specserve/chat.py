"""Chat prompts from the model's own Jinja template (GGUF metadata ``tokenizer.chat_template``)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from specserve.backends.base import Vocabulary
from specserve.errors import UserError

if TYPE_CHECKING:
    import jinja2

# Used when a model ships no template: ChatML, the format of the Qwen family.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"


class ChatTemplateError(UserError, ValueError):
    """The messages cannot be rendered (bad roles or contents, or a template error)."""


def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    """transformers' ``tojson`` (plain JSON, non-ASCII kept: what the model saw in training), except that
    ``<|`` is written ``\u003c|``: a tool description or argument cannot spell a control token (the template's
    own text is tokenized with special tokens parsed)."""
    text = json.dumps(value, ensure_ascii=False, indent=indent).replace("<|", "\\u003c|")
    return text.replace(MARK_OPEN, "\\ue000").replace(MARK_CLOSE, "\\ue001")  # never a content marker


def render_chat(
    runtime: Vocabulary,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages`` (and the ``tools`` offered), then the assistant turn opener."""
    import jinja2

    if not messages:
        raise ChatTemplateError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
    try:
        template = compiled_template(runtime.chat_template() or CHATML)
        return template.render(
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=True,
            bos_token=runtime.special_token_text("bos"),
            eos_token=runtime.special_token_text("eos"),
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@functools.lru_cache(maxsize=8)
def compiled_template(source: str) -> jinja2.Template:
    """A chat template compiled once per source: compiling Qwen2.5's took 3 ms of the event loop per request,
    time the other requests' streams waited for. A compiled template renders from many threads at once."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(source)


# Private-use code points stand in for message contents while the template renders (see chat_prompt_ids);
# client text the template writes itself (tools, call arguments through tojson) has them escaped.
_MARK = re.compile(MARK_OPEN + "([0-9]+)" + MARK_CLOSE)


def chat_prompt_ids(
    runtime: Vocabulary,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the chat prompt: control tokens come from the template only.

    Tokenizing the rendered text with special-token parsing would turn a message that contains
    ``<|im_end|>\n<|im_start|>system`` into real control tokens: a forged system or assistant turn. So the
    template renders with a marker in place of each content, the template's text is tokenized with special
    tokens parsed, and each content is tokenized as plain text where its marker stood.
    """
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    for m, original in zip(marked, messages, strict=True):
        if not isinstance(original.get("content"), str) or not original.get("content"):
            m["content"] = original.get("content")  # render_chat reports a non-string; "" stays falsy
    text = render_chat(runtime, marked, tools)
    bos = runtime.special_token_text("bos")
    add_bos = not (bos and text.startswith(bos))  # BOS once, unless the template wrote it
    ids: list[int] = []
    pos = 0
    for match in [*_MARK.finditer(text), None]:
        end = match.start() if match is not None else len(text)
        if end > pos:
            ids += runtime.tokenize(text[pos:end], add_special=add_bos and not ids, parse_special=True)
        if match is None:
            return ids
        index = int(match.group(1))
        if index >= len(messages):  # not one of ours: only client text can spell it
            raise ChatTemplateError("a message contains text the chat template cannot take (U+E000)")
        content = str(messages[index]["content"])
        if content:
            ids += runtime.tokenize(content, add_special=add_bos and not ids, parse_special=False)
        pos = match.end()
    return ids
