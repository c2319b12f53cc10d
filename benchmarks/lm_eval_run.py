"""lm-eval against a running ``specserve serve``: the multiple-choice task of tests/server/data (through
``local-completions``: loglikelihood, prompt logprobs) and a generate_until task on the same documents
(through ``local-chat-completions``), each timed with speculation off and on (the request's
``speculative`` field, sent as a generation kwarg: loglikelihood requests have no drafts to make, they
are timed both ways only to show it).

    python -m benchmarks.lm_eval_run --url http://127.0.0.1:8000 [--repeat 4]

Prints one JSON object: per task and setting, seconds, the metric, and whether on and off agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.batch_pass import cpu_model

DATA = Path(__file__).parents[1] / "tests" / "server" / "data" / "lm_eval_mc.jsonl"
TASKS = {
    "specserve_mc": """task: specserve_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list: [{{metric: acc}}]
""",
    "specserve_gen": """task: specserve_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Complete the code or sentence, then explain it in two sentences: {{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs: {{until: ["\\n\\n\\n"], max_gen_toks: 96, temperature: 0}}
metric_list: [{{metric: exact_match}}]
""",
}


def evaluate(url: str, task: str, directory: Path, speculation: bool) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_id = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    chat = task == "specserve_gen"
    model = "local-chat-completions" if chat else "local-completions"
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    args: dict[str, Any] = {"model": model_id, "base_url": f"{url}{endpoint}", "num_concurrent": 1}
    if not chat:
        args |= {"tokenizer_backend": "remote", "tokenized_requests": True}
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=model, model_args=args, tasks=[task], task_manager=TaskManager(include_path=str(directory)),
        apply_chat_template=chat, log_samples=True, bootstrap_iters=0,
        gen_kwargs={"speculative": {"enabled": speculation}} if chat else None,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    metric = {k: v for k, v in results["results"][task].items() if k.endswith(",none")}
    return {"seconds": round(seconds, 2), "metrics": metric, "responses": [s["resps"] for s in samples]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeat", type=int, default=4, help="copies of the 6 documents")
    args = parser.parse_args()
    report: dict[str, Any] = {"cpu": cpu_model(), "machine": platform.machine()}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        data = directory / "data.jsonl"
        data.write_text(DATA.read_text() * args.repeat)
        for task, template in TASKS.items():
            (directory / f"{task}.yaml").write_text(template.format(data=data))
        for task in TASKS:
            off = evaluate(args.url, task, directory, speculation=False)
            on = evaluate(args.url, task, directory, speculation=True)
            report[task] = {
                "documents": 6 * args.repeat,
                "seconds_off": off["seconds"], "seconds_on": on["seconds"],
                "speedup": round(off["seconds"] / on["seconds"], 3),
                "metrics_off": off["metrics"], "metrics_on": on["metrics"],
                "same_responses": off["responses"] == on["responses"],
            }  # fmt: skip
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
