"""``python -m benchmarks.grammar_cost``: what a grammar engine costs per token on this CPU.

For each built-in structured workload (prompts/structured.jsonl: a JSON Schema and a valid example answer),
the example is tokenized with the target's vocabulary and walked token by token as decoding walks it: the
allowed-token mask of the position, then the token consumed. Reported per engine: compile time of the schema
(cold, as for a schema seen the first time) and microseconds per token. llguidance is what specserve uses;
xgrammar is measured beside it when installed (``pip install xgrammar``; it needs torch for its masks). The
target's weights are not loaded: only its vocabulary.

    python -m benchmarks.grammar_cost [--repeats N] [--output-dir DIR] [engine flags]

(formerly ``specserve bench --in-process --grammar-cost``) writes ``DIR/grammar_cost.json`` and ``.md``: the
best of at least 3 rounds, the vocabulary of the engine flags' ``--target``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import command_line, engine_flags, engine_parser, parse, run, settings_of
from specserve.request import GrammarSpec
from specserve.structured.grammar import JSON_OPTIONS, GrammarCompiler
from specserve.structured.tokenizer import eog_ids
from specserve.tools.workloads import builtin_rows

MODULE = "benchmarks.grammar_cost"


def measure_grammar_cost(target: str, rounds: int = 3) -> dict[str, Any]:
    from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary

    vocabulary = LlamaCppVocabulary(target)
    try:
        rows = builtin_rows("structured")
        results: dict[str, Any] = {"target": target, "vocab_size": vocabulary.vocab_size, "workloads": {}}
        engines: dict[str, Engine] = {"llguidance": _llguidance(vocabulary)}
        xgrammar = _xgrammar(vocabulary)
        if xgrammar is not None:
            engines["xgrammar"] = xgrammar
        for row in rows:
            tokens = vocabulary.tokenize(json.dumps(row["example"]), add_special=False)
            cell: dict[str, Any] = {"tokens": len(tokens)}
            for name, (compile_schema, walk) in engines.items():
                start = time.perf_counter()
                compiled = compile_schema(row["schema"])
                compile_ms = 1e3 * (time.perf_counter() - start)
                best = min(walk(compiled, tokens) for _ in range(rounds))
                per_token = round(1e6 * best / len(tokens), 1)
                cell[name] = {"compile_ms": round(compile_ms, 2), "us_per_token": per_token}
            results["workloads"][row["kind"]] = cell
        results["engines"] = list(engines)
        return results
    finally:
        vocabulary.close()


Engine = tuple[Callable[[dict[str, Any]], Any], Callable[[Any, list[int]], float]]
"""(compile a schema → its compiled form, walk the tokens from a fresh state → seconds)."""


def _llguidance(vocabulary: Any) -> Engine:
    """specserve's own path: GrammarState.row_masks (the mask of one verify row) and commit."""
    compiler = GrammarCompiler(vocabulary, vocabulary.vocab_size)
    compiler.tokenizer()  # built once, outside the timings (as the server builds it once)

    def compile_schema(schema: dict[str, Any]) -> GrammarSpec:
        spec = GrammarSpec("json_schema", json.dumps(schema))
        compiler.compile(spec)  # cold: the compiler caches it for the walks
        return spec

    def walk(spec: GrammarSpec, tokens: list[int]) -> float:
        state = compiler.state(spec)
        start = time.perf_counter()
        for token in tokens:
            state.row_masks([])
            state.commit([token])
        return time.perf_counter() - start

    return compile_schema, walk


def _xgrammar(vocabulary: Any) -> Engine | None:
    """xgrammar's matcher over the same vocabulary (control tokens spell nothing), the same separators."""
    if importlib.util.find_spec("xgrammar") is None or importlib.util.find_spec("torch") is None:
        return None
    import xgrammar

    vocab = vocabulary.vocab_size
    eos_ids = eog_ids(vocabulary, vocab)
    pieces = [b"" if vocabulary.is_control(t) else vocabulary.token_bytes(t) for t in range(vocab)]
    info = xgrammar.TokenizerInfo(pieces, vocab_size=vocab, stop_token_ids=eos_ids)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    separators = (JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"])

    def compile_schema(schema: dict[str, Any]) -> Any:
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=separators)

    def walk(compiled: Any, tokens: list[int]) -> float:
        matcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for token in tokens:
            matcher.fill_next_token_bitmask(bitmask)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused token {token}")
        return time.perf_counter() - start

    return compile_schema, walk


def render_grammar_cost(data: dict[str, Any], command: str) -> str:
    engines: list[str] = data["engines"]
    out = [
        "## Grammar engine cost per token",
        "",
        f"Command: `{command}`",
        "",
        f"Vocabulary: {data['vocab_size']} tokens ({data['target']}). Per workload: the example answer's "
        "tokens, each position's allowed-token mask then the token consumed (best of the rounds); compile "
        "time of the schema, cold.",
        "",
        "| workload | tokens | " + " | ".join(f"{e} µs/token | {e} compile ms" for e in engines) + " |",
        "|---|---|" + "---|---|" * len(engines),
    ]
    for kind, cell in data["workloads"].items():
        values = " | ".join(f"{cell[e]['us_per_token']:.1f} | {cell[e]['compile_ms']:.1f}" for e in engines)
        out.append(f"| {kind} | {cell['tokens']} | {values} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    from specserve.tools.measure.engine_bench import resolve_model
    from specserve.tools.output import write_report

    parser = engine_parser(MODULE, __doc__)
    engine_flags(parser)
    args = parse(parser, argv)
    settings = settings_of(args)
    data = measure_grammar_cost(resolve_model(settings, settings.target), rounds=max(args.repeats, 3))
    write_report(args.output_dir, data, render_grammar_cost(data, command_line(MODULE, argv)), "grammar_cost")
    return 0


if __name__ == "__main__":
    sys.exit(run(MODULE, main))
