"""In-process benchmark of the engine: plain vs each drafter vs the default policy, in one interleaved run.

Every prompt is generated once per mode, the modes one after another, so that machine drift (other
processes, thermal state) spreads over all modes alike. Speed is reported as ratios to plain decoding
measured in the same run; greedy outputs are compared with the plain output token for token.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve.backends.base import detokenize
from specserve.chat import chat_prompt_ids
from specserve.config import PolicyChoice, Settings
from specserve.engine.builder import load_models
from specserve.request import GrammarSpec, SamplingParams
from specserve.sequence import Sequence
from specserve.tools.workloads import ToolInputError, builtin_rows


@dataclass(frozen=True)
class Mode:
    name: str
    drafters: tuple[str, ...]
    policy: PolicyChoice
    block_size: int | None = None
    """DFlash2 modes: the block the drafter runs at (``dflash2@8``); None: the checkpoint's."""


MODES = {
    "plain": Mode("plain", (), "fixed"),
    "ngram": Mode("ngram", ("ngram",), "fixed"),
    "suffix": Mode("suffix", ("suffix",), "cost"),  # its per-token estimate is what gates its drafts
    "draft-model": Mode("draft-model", ("draft-model",), "fixed"),
    "grammar": Mode("grammar", ("grammar",), "fixed"),  # only the tokens a request's grammar forces
    "auto": Mode("auto", ("ngram", "suffix", "draft-model", "dflash2"), "cost"),  # whichever are loaded
    "dflash2": Mode("dflash2", ("dflash2",), "fixed"),  # --draft DIR: a DFlash2 checkpoint (torch)
}


def mode(name: str) -> Mode | None:
    """A mode by name: one of MODES, or ``dflash2@B`` (the DFlash2 drafter at block size B)."""
    if name in MODES:
        return MODES[name]
    base, _, block = name.partition("@")
    if base == "dflash2" and block.isdigit() and int(block) >= 2:
        return Mode(name, ("dflash2",), "fixed", int(block))
    return None


@dataclass
class Cell:
    """Totals of one (kind, mode)."""

    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    identical: int = 0
    runs: int = 0
    forced: int = 0
    """Accepted tokens the grammar drafted (constrained prompts)."""
    grammar_seconds: float = 0.0
    """Time in the grammar engine (masks, forced tokens, commits)."""
    valid: int = 0
    """Outputs that parse as JSON and validate against the prompt's schema (constrained prompts)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, seq: Sequence, identical: bool) -> float:
        """Fold in one finished request; returns its decode-phase tokens/s (first token excluded)."""
        assert seq.first_token_time is not None and seq.finish_time is not None
        tokens, seconds = len(seq.output_ids) - 1, seq.finish_time - seq.first_token_time
        self.tokens += tokens
        self.seconds += seconds
        self.drafts += seq.stats.num_drafts
        self.draft_tokens += seq.stats.num_draft_tokens
        self.accepted += seq.stats.num_accepted_tokens
        self.identical += int(identical)
        self.runs += 1
        self.forced += seq.stats.accepted_by_drafter.get("grammar", 0)
        self.grammar_seconds += getattr(seq.grammar, "seconds", 0.0)
        return tokens / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["tokens_per_second"] = round(self.tokens_per_second, 3)
        data["acceptance_rate"] = round(self.accepted / self.draft_tokens, 4) if self.draft_tokens else 0.0
        data["mean_acceptance_length"] = round(1 + self.accepted / self.drafts, 4) if self.drafts else 1.0
        data["forced_share"] = round(self.forced / self.tokens, 4) if self.tokens else 0.0
        data["grammar_us_per_token"] = (
            round(1e6 * self.grammar_seconds / self.tokens, 1) if self.tokens else 0.0
        )
        return data


@dataclass
class EngineBenchResult:
    settings: dict[str, Any]
    costs: dict[str, Any]
    cells: dict[str, dict[str, Cell]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "costs_ms": self.costs,
            "notes": self.notes,
            "results": {k: {m: c.as_dict() for m, c in modes.items()} for k, modes in self.cells.items()},
        }


def builtin_prompts(structured: bool = False) -> list[dict[str, Any]]:
    """The engine workloads, or (``structured``) the schema-constrained ones (rows with a ``schema``)."""
    return builtin_rows("structured" if structured else "engine")


def run_engine_bench(
    settings: Settings,
    prompts: list[dict[str, Any]],
    modes: list[str],
    max_tokens: int,
    progress: Callable[[str], None] = lambda _m: None,
    repeats: int = 1,
) -> EngineBenchResult:
    """Run every prompt in every mode, modes back to back per prompt; ``repeats`` rounds, the mode order
    reversed every other round so that a mode's place in the sequence does not bias it."""
    chosen = {m: mode(m) for m in modes}
    assert all(chosen.values()), "modes are checked by the caller"
    keep_draft = any(d in ("draft-model", "dflash2") for m in chosen.values() if m for d in m.drafters)
    # No mode uses the draft model: do not load it (the server's rule would load it for auto).
    load_draft = settings.load_draft if keep_draft else "never"
    models = load_models(dataclasses.replace(settings, max_running=1, load_draft=load_draft), keep_draft)
    try:
        info = models.target.info
        summary = _settings_summary(settings) | {"runtime": info.description, "exactness": info.exactness}
        result = EngineBenchResult(summary, models.costs.as_dict(), notes=list(models.report.notes))
        pays, best = models.report.draft_pays, models.report.draft_best_speedup  # the builder's verdict
        if models.draft is not None and not pays:
            result.notes.append(f"auto excludes the draft model: at 100% acceptance it reaches {best:.2f}x")
        # One policy per mode for the whole run, as a server keeps one: its acceptance statistics carry
        # over from request to request.
        policies = {name: models.policy(m.policy) for name, m in chosen.items() if m}
        rounds = [(r, i, item) for r in range(repeats) for i, item in enumerate(prompts)]
        for r, i, item in rounds:
            prompt_ids = chat_prompt_ids(models.target, [{"role": "user", "content": item["prompt"]}])
            finished: dict[str, Sequence] = {}
            for mode_name in modes if r % 2 == 0 else modes[::-1]:
                current = chosen[mode_name]
                assert current is not None
                # The default policy only gets the draft model when it could pay (as build_engine decides).
                names = tuple(
                    n
                    for n in current.drafters
                    if n == "grammar"  # the engine's own (constrained requests), never a loaded model
                    or (n in models.drafters and (n != "draft-model" or pays or current.policy == "fixed"))
                )
                block: Any = models.drafters.get("dflash2")
                if block is not None:  # this mode's block, else the setting's, else the checkpoint's
                    block.block_size = (
                        current.block_size or settings.draft_block_size or block.net.config.block_size
                    )
                engine = models.engine(names, policies[mode_name], settings.num_draft_tokens)
                grammar = None
                if "schema" in item:
                    grammar = GrammarSpec("json_schema", json.dumps(item["schema"]))
                params = SamplingParams(max_tokens=max_tokens, grammar=grammar)
                try:
                    seq = engine.add_request(f"bench-{r}-{i}-{mode_name}", prompt_ids, params)
                except ValueError as exc:  # the prompt does not fit the context, or a bad schema
                    raise ToolInputError(str(exc)) from None
                while engine.has_work():
                    engine.step()
                finished[mode_name] = seq
            plain_ids = finished["plain"].output_ids if "plain" in finished else None
            for mode_name, seq in finished.items():
                cell = result.cells.setdefault(item["kind"], {}).setdefault(mode_name, Cell())
                speed = cell.add(seq, seq.output_ids == plain_ids)
                text = detokenize(models.target, seq.output_ids)  # no stop strings here
                cell.valid += int("schema" in item and _validates(text, item["schema"]))
                stats = seq.stats
                progress(
                    f"[{r * len(prompts) + i + 1}/{len(rounds)}] {item['kind']:8} {mode_name:12} "
                    f"{speed:6.2f} tok/s accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}"
                )
    finally:
        models.close()
    return result


def _validates(text: str, schema: Any) -> bool:
    """The output is JSON that fits the schema (jsonschema when installed, else parsing only)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def resolve_model(settings: Settings, name: str) -> str:
    from specserve.models import ModelStore

    store = ModelStore(Path(settings.model_dir) if settings.model_dir else None)
    return str(store.resolve(name))


def _settings_summary(settings: Settings) -> dict[str, Any]:
    keys = (
        "target",
        "draft",
        "backend",
        "device",
        "dtype",
        "exact",
        "threads",
        "num_draft_tokens",
        "context_size",
        "ngram_min_n",
        "draft_p_min",
    )
    return {k: getattr(settings, k) for k in keys} | {"date": time.strftime("%Y-%m-%d %H:%M")}
