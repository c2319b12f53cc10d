"""guidellm (from PyPI) benchmarks a real server: a short synchronous run on synthetic prompts completes
with no errored request and reports time to first token and inter-token latency.

guidellm counts and synthesizes tokens with a Hugging Face tokenizer: the tiny models' own vocabulary as
``tokenizer.json`` (support.tiny_hf), so nothing is fetched from a hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.tiny_hf import tiny_tokenizer_json

from .process import ServerProcess

REQUESTS = 4


def test_a_short_guidellm_run_reports_ttft_and_itl_without_errors(
    server: ServerProcess, tmp_path: Path
) -> None:
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text(tiny_tokenizer_json())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "model_max_length": 4096,
    }
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    command = [
        str(Path(sys.executable).with_name("guidellm")), "run",
        "--backend", f"kind=openai_http,target={server.url}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--disable-console-interactive",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    (benchmark,) = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert state["successful_requests"] == REQUESTS and state["errored_requests"] == 0
    metrics = benchmark["metrics"]
    for name in ("time_to_first_token_ms", "inter_token_latency_ms"):
        successful = metrics[name]["successful"]
        assert successful["count"] >= REQUESTS and successful["mean"] > 0, name  # ITL: one per token gap
    assert metrics["output_token_count"]["successful"]["mean"] == 16  # the requested length, streamed
