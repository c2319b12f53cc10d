"""An agent loop against a running ``specserve serve``: four tools, one task per question (``--turns``
questions), speculation on and off (per request), greedy.

Each task asks for something a tool answers; the model calls tools under ``tool_choice: "auto"`` (its own
spelling, through the lazy tool grammar), the loop runs them and sends the results back until the model
answers in text (a call and an answer: two model turns per task). The same tasks run with speculation
off and on. Reported per setting: completion tokens, wall seconds, tokens/s over the model's time, tool
calls made, and the share of completion tokens that were accepted drafts of each drafter (``grammar``:
tokens the tool grammar forced, drafted for free). Each run has its own ``cache_salt``: neither reuses
the other's prompt KV or, through the suffix drafter's per-tenant memory, its outputs.

    python -m benchmarks.agent_loop --url http://127.0.0.1:8000 [--turns 6]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks.batch_pass import cpu_model

TOOLS: dict[str, tuple[str, dict[str, Any], Callable[[dict[str, Any]], Any]]] = {
    "get_weather": (
        "Get the current weather in a city.",
        {"city": {"type": "string"}},
        lambda a: {"city": a.get("city"), "temperature_c": 18, "sky": "cloudy"},
    ),
    "get_time": (
        "Get the local time in a city.",
        {"city": {"type": "string"}},
        lambda a: {"city": a.get("city"), "time": "14:05"},
    ),
    "convert_currency": (
        "Convert an amount of money from one currency to another.",
        {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
        lambda a: {"amount": round(float(a.get("amount", 0)) * 1.08, 2), "currency": a.get("to")},
    ),
    "search_flights": (
        "Search flights between two cities on a date (YYYY-MM-DD).",
        {"origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string"}},
        lambda a: {
            "flights": [{"number": "AF1234", "departs": "09:15"}, {"number": "LH567", "departs": "13:40"}]
        },
    ),
}
QUESTIONS = [
    "What's the weather in Paris?",
    "And what time is it in Tokyo?",
    "Convert 250 euros to US dollars.",
    "Find flights from Paris to Berlin on 2027-01-15.",
    "What's the weather in Berlin?",
    "What time is it in Berlin?",
    "Convert 80 US dollars to euros.",
]
SYSTEM = (
    "You are a travel assistant. Use a tool when the user needs live data. When a tool result is available,"
    " reply in one short sentence using it; do not call the tool again."
)


def tool_specs() -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": props, "required": list(props)},
            },
        }
        for name, (description, props, _) in TOOLS.items()
    ]


def run(url: str, turns: int, speculation: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    salt = f"agent-loop-{speculation}-{time.time_ns()}"  # no prefix-cache or suffix memory from the other run
    totals = {"completion_tokens": 0, "requests": 0, "tool_calls": 0, "seconds": 0.0}
    accepted: dict[str, int] = {}
    answers: list[str] = []
    with httpx.Client(timeout=600) as client:
        for question in QUESTIONS[:turns]:
            # One task per question, each its own conversation: the 1.5B default model, given a whole
            # history of earlier tasks, answers later questions from memory or repeats its last call.
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            for _ in range(4):  # calls, results, ... until the model answers in text
                body = {
                    "messages": messages, "tools": tool_specs(), "temperature": 0, "max_tokens": 160,
                    "speculative": {"enabled": speculation}, "cache_salt": salt,
                }  # fmt: skip
                start = time.perf_counter()
                response = client.post(f"{url}/v1/chat/completions", json=body)
                totals["seconds"] += time.perf_counter() - start
                response.raise_for_status()
                result = response.json()
                totals["requests"] += 1
                totals["completion_tokens"] += result["usage"]["completion_tokens"]
                for name, count in result["speculative"]["accepted_by_drafter"].items():
                    accepted[name] = accepted.get(name, 0) + count
                message = result["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                calls = message.get("tool_calls") or []
                if not calls:
                    answers.append(message.get("content") or "")
                    break
                totals["tool_calls"] += len(calls)
                for call in calls:
                    arguments = json.loads(call["function"]["arguments"])
                    output = TOOLS[call["function"]["name"]][2](arguments)
                    messages.append(
                        {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(output)}
                    )
    tokens = totals["completion_tokens"]
    return {
        **totals,
        "seconds": round(float(totals["seconds"]), 2),
        "tokens_per_second": round(tokens / float(totals["seconds"]), 2),
        "accepted_share_by_drafter": {k: round(v / tokens, 3) for k, v in sorted(accepted.items())},
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    off = run(args.url, args.turns, speculation=False)
    on = run(args.url, args.turns, speculation=True)
    report = {
        "cpu": cpu_model(), "machine": platform.machine(), "turns": args.turns,
        "speculation_off": off, "speculation_on": on,
        "speedup": round(on["tokens_per_second"] / off["tokens_per_second"], 3),
        "same_conversation": off["answers"] == on["answers"]
        and off["completion_tokens"] == on["completion_tokens"],
    }  # fmt: skip
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
