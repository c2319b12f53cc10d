"""lm-eval (installed from PyPI) against a real server: a multiple-choice task from a local file through
``local-completions`` (loglikelihood: token-id prompts, ``echo`` with ``logprobs``, the remote tokenizer
over ``/tokenizer_info``, ``/tokenize``, ``/detokenize``) and a generate_until task through
``local-chat-completions``. Speculation on and off give the same accuracy and the same per-choice logprobs
and generations."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.tiny_models import TinyModels

from .process import ServerProcess, start_server, stop_server

lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data" / "lm_eval_mc.jsonl"
ADMIN_KEY = "lm-eval-admin"

MULTIPLE_CHOICE = """\
task: specserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GENERATE = """\
task: specserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Complete the line: {{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def eval_server(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("lm-eval-server")
    proc = start_server(tiny_models, directory, env={"SPECSERVE_ADMIN_KEY": ADMIN_KEY})
    yield proc
    assert stop_server(proc) == 0, proc.log()
    assert "Traceback" not in proc.log()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from lm_eval.tasks import TaskManager

    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    data = directory / DATA.name
    shutil.copy(DATA, data)
    (directory / "specserve_mc.yaml").write_text(MULTIPLE_CHOICE.format(data=data))
    (directory / "specserve_gen.yaml").write_text(GENERATE.format(data=data))
    return TaskManager(include_path=str(directory))


def _speculation(server: ServerProcess, enabled: bool) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    response = httpx.post(f"{server.url}/admin/speculation", json={"enabled": enabled}, headers=headers)
    assert response.status_code == 200, response.text


def _evaluate(server: ServerProcess, tasks: Any, model: str, task: str, **model_args: Any) -> dict[str, Any]:
    model_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    args = {"model": model_id, "max_retries": 1, "num_concurrent": 1, **model_args}
    results: dict[str, Any] = lm_eval.simple_evaluate(
        model=model, model_args=args, tasks=[task], task_manager=tasks, log_samples=True,
        apply_chat_template=model == "local-chat-completions", bootstrap_iters=0,
    )  # fmt: skip
    return results


def _per_doc(results: dict[str, Any], task: str) -> list[Any]:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_loglikelihood_is_the_same_with_speculation_on_and_off(
    eval_server: ServerProcess, tasks: Any
) -> None:
    base_url = f"{eval_server.url}/v1/completions"
    runs = {}
    for enabled, batch in ((True, 1), (False, 4)):  # batched: several token-id prompts per request
        _speculation(eval_server, enabled)
        runs[enabled] = _evaluate(
            eval_server, tasks, "local-completions", "specserve_mc",
            base_url=base_url, tokenizer_backend="remote", tokenized_requests=True, batch_size=batch,
        )  # fmt: skip
    _speculation(eval_server, True)
    on, off = runs[True], runs[False]
    assert on["results"]["specserve_mc"]["acc,none"] == off["results"]["specserve_mc"]["acc,none"]
    per_choice_on, per_choice_off = _per_doc(on, "specserve_mc"), _per_doc(off, "specserve_mc")
    assert per_choice_on == per_choice_off
    assert len(per_choice_on) == 6 and all(len(r) in (3, 4) for r in per_choice_on)
    logprobs = [float(lp) for doc in per_choice_on for ((lp, _greedy),) in doc]
    assert all(lp < 0 for lp in logprobs) and len(set(logprobs)) == len(logprobs)  # real, distinct numbers


def test_generate_until_through_chat_completions_is_the_same_with_speculation_on_and_off(
    eval_server: ServerProcess, tasks: Any
) -> None:
    base_url = f"{eval_server.url}/v1/chat/completions"
    runs = {}
    for enabled in (True, False):
        _speculation(eval_server, enabled)
        runs[enabled] = _evaluate(
            eval_server, tasks, "local-chat-completions", "specserve_gen", base_url=base_url
        )
    _speculation(eval_server, True)
    on, off = _per_doc(runs[True], "specserve_gen"), _per_doc(runs[False], "specserve_gen")
    assert on == off and len(on) == 6 and all(doc[0][0] for doc in on)  # non-empty generations
