"""instructor (from PyPI) on the real default model (marked ``model``): its TOOLS, JSON_SCHEMA, JSON and
PARALLEL_TOOLS modes give validated pydantic objects, and ``create_partial`` streams several partial
objects before the final one, the same final object with speculation on and off (greedy)."""

from __future__ import annotations

from collections.abc import Iterable

import instructor  # installed by scripts/install.sh --dev (without its jiter cap: the script says why)
import openai
import pytest
from pydantic import BaseModel, Field

from specserve.models import DEFAULT_TARGET

pytestmark = pytest.mark.model

OFF = {"speculative": {"enabled": False}}
TEXT = (
    "Extract: Jason is 25 years old and likes chess, hiking and jazz. "
    "He grew up in Lyon and now writes software in Berlin."
)


class Person(BaseModel):
    name: str
    age: int
    hobbies: list[str]
    biography: str = Field(description="one sentence about the person")


class Weather(BaseModel):
    """Get the weather in a city."""

    city: str


class LocalTime(BaseModel):
    """Get the local time in a city."""

    city: str


def _client(base_url: str, mode: instructor.Mode) -> instructor.Instructor:
    return instructor.from_openai(openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused"), mode=mode)


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON])
def test_each_mode_gives_the_validated_object(base_url: str, mode: instructor.Mode) -> None:
    client = _client(base_url, mode)
    person = client.chat.completions.create(
        model=DEFAULT_TARGET, response_model=Person, messages=[{"role": "user", "content": TEXT}],
        temperature=0, max_retries=0,
    )  # fmt: skip
    assert (person.name, person.age) == ("Jason", 25)
    assert {"chess", "hiking", "jazz"} <= {h.lower() for h in person.hobbies}


def test_parallel_tools_mode_gives_calls_as_objects(base_url: str) -> None:
    client = _client(base_url, instructor.Mode.PARALLEL_TOOLS)
    calls = client.chat.completions.create(
        model=DEFAULT_TARGET, response_model=Iterable[Weather | LocalTime],  # type: ignore[type-abstract]
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0, max_retries=0,
    )  # fmt: skip
    assert [type(c).__name__ for c in calls] == ["Weather"]  # the 1.5B model writes one call here


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_create_partial_streams_partial_objects_then_the_final_one(
    base_url: str, mode: instructor.Mode
) -> None:
    client = _client(base_url, mode)
    finals = []
    for i, extra in enumerate(({}, OFF)):
        # A tenant of its own: from the server's earlier answer to the same prompt the suffix drafter could
        # copy the whole object in one step (with drafts as long as the default 32), leaving nothing partial.
        salt = {"cache_salt": f"partial-{mode.value}-{i}"}
        stream = client.chat.completions.create_partial(
            model=DEFAULT_TARGET, response_model=Person, messages=[{"role": "user", "content": TEXT}],
            temperature=0, max_retries=0, extra_body={**extra, **salt},
        )  # fmt: skip
        partials = list(stream)
        assert len(partials) >= 3, partials  # arguments arrive in pieces, not whole
        assert any(p.name == "Jason" and p.biography is None for p in partials)  # a real partial object
        finals.append(partials[-1])
    assert finals[0] == finals[1] and finals[0].age == 25
