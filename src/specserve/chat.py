"""Chat prompts from the model's own Jinja template (GGUF metadata ``tokenizer.chat_template``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from specserve.backends.base import ModelRuntime

# Used when a model ships no template: ChatML, the format of the Qwen family.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad roles or contents, or a template error)."""


def render_chat(runtime: ModelRuntime, messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt text for ``messages`` followed by the assistant's turn opener."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not messages:
        raise ChatTemplateError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(runtime.chat_template() or CHATML)
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=True,
            bos_token=runtime.special_token_text("bos"),
            eos_token=runtime.special_token_text("eos"),
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
