"""Clients nobody here wrote, installed from PyPI, against a live server (tiny models): LangChain's
``ChatOpenAI`` (``langchain-openai``), LiteLLM and the ``llm`` CLI — each a chat, a stream, a tool call and a
structured output. The tiny target is a random model, so tool calls are the ones ``tool_choice`` forces
(a named function); the real model's own tool calls are in tests/integration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from .process import ServerProcess

MODEL = "tiny-target"


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {**Person.model_json_schema(), "additionalProperties": False},  # else a random model
        "strict": True,  # goes on adding keys
    },
}


# -- LangChain --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server: ServerProcess) -> Any:
    from langchain_openai import ChatOpenAI

    options: dict[str, Any] = {
        "base_url": f"{server.url}/v1",
        "api_key": "x",
        "max_tokens": 24,
        "max_retries": 0,
    }
    return ChatOpenAI(model=MODEL, temperature=0, **options)


def test_langchain_chat_and_stream(chat_model: Any) -> None:
    text = chat_model.invoke("Say hi").content
    assert isinstance(text, str) and text
    streamed = "".join(str(chunk.content) for chunk in chat_model.stream("Say hi"))
    assert streamed == text


def test_langchain_bind_tools_with_a_forced_tool(chat_model: Any) -> None:
    bound = chat_model.bind_tools([TIME_TOOL], tool_choice="get_time")
    message = bound.invoke("What time is it in Paris?", max_tokens=200)
    assert [call["name"] for call in message.tool_calls] == ["get_time"]
    assert message.tool_calls[0]["args"]["zone"] in ("utc", "cet")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model: Any, method: str) -> None:
    structured = chat_model.with_structured_output(Person, method=method, strict=True)  # no extra keys
    person = structured.invoke("Describe a person.", max_tokens=200)
    assert isinstance(person, Person)


# -- LiteLLM ----------------------------------------------------------------------------------------


def _litellm(server: ServerProcess, **kw: Any) -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    return litellm.completion(
        model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="x", temperature=0, **kw
    )


def test_litellm_chat_stream_tool_and_structured_output(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    text = _litellm(server, messages=messages, max_tokens=16).choices[0].message.content
    assert isinstance(text, str) and text
    chunks = _litellm(server, messages=messages, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    named = {"type": "function", "function": {"name": "get_time"}}
    called = _litellm(server, messages=messages, max_tokens=200, tools=[TIME_TOOL], tool_choice=named)
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")
    structured = _litellm(server, messages=messages, max_tokens=200, response_format=PERSON_FORMAT)
    Person.model_validate_json(structured.choices[0].message.content)


# -- the llm CLI ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_cli(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``llm`` with specserve registered as an OpenAI-compatible model (extra-openai-models.yaml)."""
    home = tmp_path_factory.mktemp("llm-home")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: specserve\n  model_name: {MODEL}\n  api_base: {server.url}/v1\n"
        "  supports_tools: true\n  supports_schema: true\n  can_stream: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "x"}
    cli = Path(sys.executable).parent / "llm"

    def run(*args: str) -> str:
        done = subprocess.run(
            [str(cli), "-m", "specserve", "-o", "temperature", "0", *args],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    return run


def test_llm_cli_chat_stream_schema_and_tool(llm_cli: Any) -> None:
    plain = llm_cli("--no-stream", "-o", "max_tokens", "16", "Say hi")
    streamed = llm_cli("-o", "max_tokens", "16", "Say hi")
    assert plain.strip() and streamed.strip() == plain.strip()
    schema = json.dumps({**Person.model_json_schema(), "additionalProperties": False})
    person = Person.model_validate_json(
        llm_cli("--no-stream", "-o", "max_tokens", "200", "--schema", schema, "A person")
    )
    assert person.age >= 0
    tools_sent = llm_cli("--no-stream", "-o", "max_tokens", "8", "-T", "llm_time", "What time is it?")
    assert tools_sent.strip()  # the tool is offered; whether to call it is the model's (integration test)
