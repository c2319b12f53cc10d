"""``specserve serve --backend torch --draft DIR`` with a DFlash2 checkpoint, through the ``openai`` client:
the drafter is recognised by its config.json, a request selects it by name, greedy output equals plain,
the per-drafter metrics count it, and a request naming a drafter that is not loaded is a 400."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from support.tiny_models import TinyModels, tiny_vocab

from .process import ServerProcess, start_server, stop_server

pytest.importorskip("torch")

MODEL = "tiny-target"
PROMPT = "def add(self, other):\n    return self.value + other.value\n"


@pytest.fixture(scope="module")
def server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from support.tiny_dflash import write_tiny_dflash

    directory = tmp_path_factory.mktemp("dflash2-server")
    checkpoint = write_tiny_dflash(
        directory / "drafter", vocab_size=len(tiny_vocab().tokens), mask_token_id=tiny_vocab().special_ids[0]
    )
    proc = start_server(
        tiny_models, directory, "--backend", "torch", "--device", "cpu", "--max-running", "2",
        "--draft", str(checkpoint), "--load-draft", "auto", "--draft-block-size", "3",
    )  # fmt: skip
    yield proc
    assert stop_server(proc) == 0, proc.log()
    assert "Traceback" not in proc.log()


def test_dflash2_is_loaded_and_selected_per_request(server: ServerProcess) -> None:
    ready = httpx.get(f"{server.url}/ready").json()
    assert set(ready["drafters"]) == {"ngram", "suffix", "dflash2"}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)

    def complete(speculative: dict[str, object]) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24, extra_body={"speculative": speculative}
        )

    plain = complete({"enabled": False})
    spec = complete({"drafter": "dflash2"})
    assert spec.choices[0].text == plain.choices[0].text
    stats = (spec.model_extra or {})["speculative"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] <= 2 * stats["num_drafts"]  # block 3
    assert stats["drafts_by_drafter"] == {"dflash2": stats["num_drafts"]}
    metrics = httpx.get(f"{server.url}/metrics").text
    drafted = re.search(r'spec_decode_drafter_num_draft_tokens_total\{drafter="dflash2"\} (\S+)', metrics)
    assert drafted is not None and float(drafted.group(1)) >= stats["num_draft_tokens"]
    with pytest.raises(openai.BadRequestError) as info:
        complete({"drafter": "draft-model"})
    assert "not available" in str(info.value)
