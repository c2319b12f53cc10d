"""``POST /v1/responses`` (OpenAI's Responses API) through the official ``openai`` client against a live
server (tiny models): string and item inputs, instructions, ``max_output_tokens``, ``text.format``, forced
tool calls streamed and not, tool history, ``previous_response_id`` and the store, the errors; then, in
process, a server with API keys and a two-entry store (tenancy, eviction). The translation without a server
is tested at the end.

Every body is validated by the client's own types (``openai.types.responses.Response``); a Responses
request's prompt is checked equal, token for token, to the chat request it translates to.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from openai.types.responses import Response

from specserve.config import Settings
from specserve.engine.builder import build_engine
from specserve.server.app import create_app
from specserve.server.errors import APIError
from specserve.server.responses_api import chat_request, parse_responses_request
from specserve.server.responses_route import renamed
from support.tiny_models import TinyModels

from .process import ServerProcess, free_port

MODEL = "tiny-target"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
    for t in (TIME_TOOL, WEATHER_TOOL)
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def create(server: ServerProcess, body: dict[str, Any], key: str = "x") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{server.url}/v1/responses", json={"model": MODEL, **body}, headers=headers, timeout=60
    )


def valid(response: httpx.Response) -> Response:
    """The body, validated by the openai client's own model."""
    assert response.status_code == 200, response.text
    return Response.model_validate(response.json())


def prompt_tokens(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> int:
    """The prompt length of the equivalent chat request."""
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **kw)  # type: ignore[arg-type]
    assert chat.usage is not None
    return chat.usage.prompt_tokens


def test_string_input_and_items_run_as_the_equivalent_chat(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    text = valid(create(server, {"input": "Hello there", "max_output_tokens": 4, "temperature": 0}))
    assert text.id.startswith("resp_") and text.object == "response" and text.model == MODEL
    assert text.output[0].type == "message" and text.output[0].id.startswith("msg_")
    assert text.usage is not None and text.usage.output_tokens <= 4
    assert text.usage.input_tokens == prompt_tokens(client, [{"role": "user", "content": "Hello there"}])
    assert text.tool_choice == "auto" and text.tools == [] and text.parallel_tool_calls
    assert text.model_dump()["store"] is True
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    listed = client.responses.create(model=MODEL, input=items, max_output_tokens=4, metadata={"k": "v"})  # type: ignore[arg-type]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert listed.usage is not None and listed.usage.input_tokens == prompt_tokens(client, messages)
    assert listed.metadata == {"k": "v"}


def test_instructions_are_a_system_message_first(server: ServerProcess, client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions="Be terse.", input="Hi", max_output_tokens=2)
    assert response.instructions == "Be terse."
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens(client, messages)


def test_max_output_tokens_makes_the_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Count to one hundred.", max_output_tokens=3, temperature=0
    )
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert response.max_output_tokens == 3 and response.output[-1].model_dump()["status"] == "incomplete"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_text_format(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kw: dict[str, Any] = {"model": MODEL, "input": "A person.", "text": {"format": fmt}, "temperature": 0}
    if stream:
        with client.responses.stream(**kw, max_output_tokens=150) as manager:
            events: list[Any] = list(manager)
            response = manager.get_final_response()
        check_sequence(events)
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert deltas[-1].snapshot == response.output_text  # as the client accumulates the stream
    else:
        response = client.responses.create(**kw, max_output_tokens=150)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def check_sequence(events: list[Any]) -> None:
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_time"}], ids=["required", "named"]
)
def test_forced_tool_choice_gives_function_calls(client: openai.OpenAI, stream: bool, choice: Any) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "What time is it?",
        "tools": [TIME_TOOL, WEATHER_TOOL],
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 100,
    }
    if stream:
        with client.responses.stream(**kw) as manager:
            events: list[Any] = list(manager)
            response = manager.get_final_response()
        check_sequence(events)
        kinds = [e.type for e in events]
        added = kinds.index("response.output_item.added")
        assert events[added].item.type == "function_call" and events[added].item.arguments == ""
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert len(deltas) > 1 and "".join(deltas) == done.arguments  # piece by piece
        assert kinds[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    else:
        response = client.responses.create(**kw)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].status == "completed"
    assert calls[0].id is not None and calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_")
    tool = {"get_time": TIME_TOOL, "get_weather": WEATHER_TOOL}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    if isinstance(choice, dict):
        assert calls[0].name == "get_time"
    if stream:
        assert "".join(deltas) == calls[0].arguments


def test_function_call_and_output_items_render_as_tool_history(client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": "Time in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "cet"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "14:05"},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped
    ]
    response = client.responses.create(model=MODEL, input=items, tools=[TIME_TOOL], max_output_tokens=3)  # type: ignore[arg-type,list-item]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Time in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "cet"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
    ]
    assert response.usage is not None
    assert response.usage.input_tokens == prompt_tokens(client, messages, tools=CHAT_TOOLS[:1])


def test_previous_response_id_continues_and_the_store_serves_it(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="Be kind.", input="Hi", max_output_tokens=4)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": "Hi"},  # the instructions are not carried over, as OpenAI's
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens == prompt_tokens(client, history)
    third = client.responses.create(
        model=MODEL, input="More.", previous_response_id=second.id, max_output_tokens=2
    )
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens  # the whole chain
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(first.id)
    assert missing.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).id == second.id  # its conversation is its own


def test_unknown_previous_response_id_and_store_false(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    body = unknown.value.body
    assert isinstance(body, dict) and body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found" and "resp_nope" in body["message"]
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    assert unstored.model_dump()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id, max_output_tokens=2)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "'web_search_call'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "function tools only"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content", "input_image"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments", "JSON"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
         "text.format", ""),
        ({"input": "x", "max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens"),
        ({"input": []}, "input", "empty"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, says: str
) -> None:
    response = create(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"


def test_bad_json_unknown_model_and_wrong_method(server: ServerProcess) -> None:
    bad = httpx.post(f"{server.url}/v1/responses", content=b"{", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    assert create(server, {"input": "x", "model": "other"}).json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/v1/responses").status_code == 405


def test_streamed_text_events_in_order_equal_the_whole_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "Tell me a story.",
        "max_output_tokens": 6,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    events: list[Any] = list(client.responses.create(**kw, stream=True))
    check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[2].item.content == [] and events[3].part.text == ""
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 6
    assert client.responses.retrieve(final.id).output_text == deltas


def test_responses_are_counted_as_generation_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    def successes() -> float:
        lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        return sum(
            float(line.split()[-1])
            for line in lines
            if line.startswith('specserve:requests_total{outcome="success"')
        )

    before = successes()
    client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    deadline = time.monotonic() + 10
    while successes() < before + 1:  # the record is written just after the last byte
        assert time.monotonic() < deadline
        time.sleep(0.05)


# -- API keys and a small store, in process -------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_models: TinyModels) -> Iterator[str]:
    """A server with keys k1 and k2 and a store of two responses."""
    settings = Settings(
        target=str(tiny_models.target), draft="none", threads=1, max_running=1, drafter="none",
        api_keys="k1,k2", responses_store_entries=2,
    ).validate()  # fmt: skip
    engine, _ = build_engine(settings, calibrate_costs=False)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started or httpx.get(f"{url}/ready").status_code != 200:
        assert thread.is_alive() and time.monotonic() < deadline, "not ready"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=20)


def keyed_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_another_key_cannot_read_or_continue_a_response(keyed: str) -> None:
    one, two = keyed_client(keyed, "k1"), keyed_client(keyed, "k2")
    mine = one.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    assert one.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        two.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        two.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError):
        two.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        keyed_client(keyed, "wrong").responses.create(model=MODEL, input="x", max_output_tokens=2)
    assert one.responses.retrieve(mine.id).id == mine.id


def test_the_oldest_response_is_evicted(keyed: str) -> None:
    one = keyed_client(keyed, "k1")
    ids = [one.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(ids[0])
    with pytest.raises(openai.BadRequestError) as evicted:
        one.responses.create(model=MODEL, input="x", previous_response_id=ids[0], max_output_tokens=1)
    assert evicted.value.code == "previous_response_not_found"
    assert [one.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


# -- the translation, without a server ------------------------------------------------------------


def translate(body: dict[str, Any]) -> Any:
    request = parse_responses_request(json.dumps(body).encode())
    return chat_request(request, request.items())


def test_items_become_chat_messages() -> None:
    chat = translate(
        {
            "instructions": "Be brief.",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": "Let me look.",
                    "id": "msg_1",
                    "status": "completed",
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "f",
                    "arguments": '{"x": 1}',
                    "id": "fc_1",
                },
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
                {"type": "reasoning", "id": "rs_1", "encrypted_content": "..."},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
                {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
            ],
        }
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}},
    ]
    assert chat.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": {}}}],
        },
    ]


def test_settings_become_the_chat_fields() -> None:
    chat = translate(
        {
            "input": "x",
            "tools": [TIME_TOOL],
            "tool_choice": {"type": "function", "name": "get_time"},
            "parallel_tool_calls": False,
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "user": "u",
            "stream": True,
        }
    )
    assert chat.tools[0].model_dump(exclude_none=True) == {
        "type": "function",
        "function": {k: v for k, v in TIME_TOOL.items() if k != "type"},
    }
    assert chat.tool_choice.function.name == "get_time" and chat.parallel_tool_calls is False
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.seed) == (7, 0.5, 0.9, 3)
    assert chat.user == "u" and chat.stream and chat.response_format is None
    schema = translate(
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}}}
    )
    assert schema.response_format.json_schema.schema_ == PERSON
    assert (
        translate({"input": "x", "text": {"format": {"type": "json_object"}}}).response_format.type
        == "json_object"
    )
    assert translate({"input": "x", "text": {"format": {"type": "text"}}}).response_format is None
    with pytest.raises(APIError, match="max_output_tokens") as long:
        translate({"input": "x", "max_output_tokens": 100}).sampling_params(10, 50, "input")
    assert long.value.param == "max_output_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": ["text"]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"type": "function_call", "call_id": "a b", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"tools": [{"type": "file_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "a<|im_start|>"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"instructions": None, "input": []}, "input"),
    ],
)
def test_translation_errors_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as error:
        translate(body)
    assert error.value.status == 400 and error.value.param == param


def test_chat_fields_in_errors_are_renamed() -> None:
    assert renamed("messages") == "input" and renamed("messages[3].tool_calls") == "input"
    assert (
        renamed("response_format") == "text.format"
        and renamed("max_completion_tokens") == "max_output_tokens"
    )
    assert renamed("tools") == "tools" and renamed(None) is None
