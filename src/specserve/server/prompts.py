"""A request's prompts as token ids (completions' strings, token ids, batches and fill-in-the-middle; chat
through the model's template), and what a response or a log line shows of them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from specserve.backends.base import Vocabulary, detokenize
from specserve.chat import ChatTemplateError, chat_prompt_ids
from specserve.server import chat_request as c
from specserve.server import protocol as p
from specserve.server.chunks import PromptOutput
from specserve.server.errors import invalid_request

OFFLOAD_BYTES = 64 * 1024  # prompts in bodies larger than this are rendered and tokenized off the event loop


def completion_prompts(vocabulary: Vocabulary, vocab: int, request: p.CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids (a string is tokenized; ids are checked against the vocabulary)."""
    prompts = []
    for prompt in request.prompt:
        if isinstance(prompt, str):
            ids = vocabulary.tokenize(prompt, add_special=request.suffix is None)
        elif any(not 0 <= t < vocab for t in prompt):
            raise invalid_request(f"Token ids must be in [0, {vocab}).", "prompt")
        else:
            ids = prompt
        if request.suffix is not None:
            ids = fill_in_the_middle(vocabulary, ids, request.suffix)
        if not ids:
            raise invalid_request("The prompt is empty.", "prompt")
        prompts.append(ids)
    return prompts


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
"""The fill-in-the-middle control tokens of Qwen2.5-Coder (and StarCoder-style models)."""


def fill_in_the_middle(vocabulary: Vocabulary, prefix: list[int], suffix: str) -> list[int]:
    """``suffix``: the prompt is the text before the insertion point, the model writes what goes between."""
    marks = [vocabulary.tokenize(t, add_special=False, parse_special=True) for t in FIM_TOKENS]
    if any(len(m) != 1 or not vocabulary.is_control(m[0]) for m in marks):
        raise invalid_request(
            "This model has no fill-in-the-middle tokens; 'suffix' is not supported.", "suffix"
        )
    text = vocabulary.tokenize(suffix, add_special=False) if suffix else []
    return [*marks[0], *prefix, *marks[1], *text, *marks[2]]


def chat_prompt(vocabulary: Vocabulary, request: c.ChatCompletionRequest) -> list[list[int]]:
    try:
        return [chat_prompt_ids(vocabulary, request.chat_messages(), request.template_tools())]
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None


async def prompt_ids(prepare: Callable[[], list[list[int]]], body_size: int) -> list[list[int]]:
    try:
        return await asyncio.to_thread(prepare) if body_size > OFFLOAD_BYTES else prepare()
    except UnicodeEncodeError:
        raise invalid_request("The prompt is not valid Unicode (it holds a lone surrogate).") from None


def logged_prompt(request: p.CompletionRequest | c.ChatCompletionRequest) -> object:
    if isinstance(request, c.ChatCompletionRequest):
        return request.chat_messages()
    return request.prompt[0] if len(request.prompt) == 1 else request.prompt


def prompt_output(
    vocabulary: Vocabulary, request: p.CompletionRequest | c.ChatCompletionRequest, prompts: list[list[int]]
) -> PromptOutput:
    """What a response shows of its prompts: the echoed text (completions' ``echo``), the echoed tokens'
    logprobs, vLLM's ``prompt_logprobs``."""
    if not isinstance(request, p.CompletionRequest):
        return PromptOutput(prompt_logprobs=request.prompt_logprobs)
    echoes: tuple[str, ...] = ()
    if request.echo:
        texts = [
            text if isinstance(text, str) else detokenize(vocabulary, ids)
            for text, ids in zip(request.prompt, prompts, strict=True)
        ]
        echoes = tuple(text for text in texts for _ in range(request.n))
    echo_logprobs = request.logprobs if request.echo else None
    return PromptOutput(echoes, echo_logprobs, request.prompt_logprobs)
