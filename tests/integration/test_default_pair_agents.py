"""Agent frameworks from PyPI run their tool loops on the real default model (marked ``model``).

The OpenAI Agents SDK (its default Responses model and its chat-completions model), the openai client's
``responses`` API and pydantic-ai, unchanged, against ``specserve serve``:
the model's call, in whatever spelling it writes under ``tool_choice: "auto"`` (the doubled braces its
template shows, a fenced object), becomes a call, the tool runs, and the model's answer uses its result —
streamed and not, with speculation on and off alike (greedy).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from specserve.models import DEFAULT_TARGET

pytestmark = pytest.mark.model

INSTRUCTIONS = (
    "Answer the user's question. When a tool result is available, reply in one sentence using it; "
    "do not call the tool again."
)
QUESTION = "What's the weather in Paris?"
OFF = {"speculative": {"enabled": False}}


def _weather(calls: list[str]) -> Any:
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "temperature_c": 18, "sky": "cloudy"})

    return get_weather


def _agents_sdk_runs(base_url: str, responses: bool) -> list[tuple[str, list[str]]]:
    """The OpenAI Agents SDK's tool loop on its Responses model or its chat-completions model: the final
    answer and the tool's calls, not streamed and streamed, with speculation on and off."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    model_class = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel

    async def run(extra: dict[str, Any] | None, stream: bool) -> tuple[str, list[str]]:
        calls: list[str] = []
        agent = Agent(
            name="assistant",
            instructions=INSTRUCTIONS,
            tools=[function_tool(_weather(calls))],
            model=model_class(model=DEFAULT_TARGET, openai_client=client),
            model_settings=ModelSettings(temperature=0, extra_body=extra),
        )
        if not stream:
            result = await Runner.run(agent, QUESTION, max_turns=4)
            return str(result.final_output), calls
        streamed = Runner.run_streamed(agent, QUESTION, max_turns=4)
        events = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in events
        return str(streamed.final_output), calls

    async def every_run() -> list[tuple[str, list[str]]]:  # one event loop: the client is bound to it
        return [await run(extra, stream) for extra in (None, OFF) for stream in (False, True)]

    return asyncio.run(every_run())


@pytest.mark.parametrize("responses", [True, False], ids=["responses-model", "chat-completions-model"])
def test_the_openai_agents_sdk_runs_its_tool_loop(base_url: str, responses: bool) -> None:
    outputs = _agents_sdk_runs(base_url, responses)
    answer, calls = outputs[0]
    assert calls == ["Paris"]  # one call, in the model's own spelling, parsed and run
    assert "18" in answer  # the answer uses the tool's result
    assert all(output == outputs[0] for output in outputs), outputs  # streamed or not, speculation or not


class Weather(BaseModel):
    city: str
    temperature_c: int


def test_pydantic_ai_runs_its_tool_loop_with_text_typed_and_streamed_output(base_url: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    provider = OpenAIProvider(base_url=f"{base_url}/v1", api_key="unused")
    calls: list[str] = []
    agent = Agent(
        OpenAIChatModel(DEFAULT_TARGET, provider=provider),
        instructions=INSTRUCTIONS,
        model_settings=ModelSettings(temperature=0),
    )
    agent.tool_plain(_weather(calls))

    async def run() -> tuple[str, Weather, str]:
        text = (await agent.run(QUESTION)).output
        typed = (
            await agent.run(f"{QUESTION} Give the city and the temperature.", output_type=Weather)
        ).output
        async with agent.run_stream(QUESTION) as stream:
            pieces = [piece async for piece in stream.stream_text(delta=True)]
        return text, typed, "".join(pieces)

    text, typed, streamed = asyncio.run(run())
    assert calls == ["Paris"] * 3
    assert "18" in text and streamed == text
    assert isinstance(typed, Weather) and typed.city == "Paris"  # its output tool, validated by pydantic


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_streamed_calls_are_byte_identical_with_speculation_off_and_16_token_drafts(base_url: str) -> None:
    """The same conversations streamed plain and with 16-token drafts (several tokens per engine step):
    the assembled calls and the content agree byte for byte, and the arguments arrived in pieces."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    conversations = [
        [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
        [{"role": "user", "content": "What's the weather and the local time in Tokyo?"}],
    ]

    def streamed(messages: list[dict[str, str]], speculative: dict[str, Any]) -> tuple[str, Any, int]:
        chunks: Any = client.chat.completions.create(
            model=DEFAULT_TARGET, messages=cast(Any, messages), tools=cast(Any, [WEATHER_TOOL, TIME_TOOL]),
            temperature=0, max_tokens=120, stream=True, extra_body={"speculative": speculative},
        )  # fmt: skip
        content, calls, pieces = "", dict[int, list[str]](), 0
        for chunk in chunks:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                assert call.function is not None
                entry = calls.setdefault(call.index, [call.function.name or "", ""])
                entry[1] += call.function.arguments or ""
                pieces += 1
        return content, calls, pieces

    for messages in conversations:
        plain = streamed(messages, {"enabled": False})
        drafted = streamed(messages, {"drafter": "suffix", "num_draft_tokens": 16})
        assert plain[:2] == drafted[:2]
        assert plain[1], plain  # the model called a tool
        assert plain[2] > len(plain[1])  # arguments in pieces, not whole
        for name, arguments in plain[1].values():
            assert name in ("get_weather", "get_time") and "city" in json.loads(arguments)


def test_the_openai_clients_responses_create_and_stream_with_tools(base_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    tool = {"type": "function", **cast(dict[str, Any], WEATHER_TOOL["function"])}  # the Responses API's form
    kwargs: dict[str, Any] = {
        "model": DEFAULT_TARGET, "instructions": INSTRUCTIONS, "input": QUESTION, "tools": [tool],
        "temperature": 0,
    }  # fmt: skip
    response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    pieces: list[str] = []
    # Streamed plainly, one token per step: a long enough draft (the default 32; this server drafts 16) holds
    # the whole call, which then arrives as one delta. The drafted answer above must equal it all the same.
    with client.responses.stream(**kwargs, extra_body={"speculative": {"enabled": False}}) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        final = stream.get_final_response()
    (streamed_call,) = [item for item in final.output if item.type == "function_call"]
    assert "".join(pieces) == streamed_call.arguments == call.arguments and len(pieces) > 1
    result = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "cloudy"})
    answer = client.responses.create(
        **{**kwargs, "input": [{"type": "function_call_output", "call_id": call.call_id, "output": result}]},
        previous_response_id=response.id,
    )
    assert "18" in answer.output_text and answer.usage is not None
    assert response.usage is not None and answer.usage.input_tokens > response.usage.input_tokens
