"""Build a ready engine from settings: resolve models, load runtimes, calibrate costs, choose drafters."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.backends.base import ModelRuntime
from specserve.config import Settings
from specserve.drafters.base import Drafter
from specserve.engine.draft_policy import CostAwarePolicy, DraftLengthPolicy, FixedLengthPolicy
from specserve.drafters.registry import DrafterContext, build_drafter
from specserve.engine.cost_model import CostModel, StepCostTable, cached_calibration
from specserve.engine.engine import EngineOptions, SpeculativeEngine
from specserve.engine.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from specserve.models import ModelStore

log = logging.getLogger("specserve.builder")


@dataclass
class BuildReport:
    """What happened while building, for logs, ``/ready`` and metrics."""

    target_path: str = ""
    draft_path: str | None = None
    drafters: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    degraded: bool = False
    seconds: float = 0.0


def draft_model_can_pay(costs: CostModel, max_k: int) -> tuple[bool, float]:
    """Best speed-up the draft model could reach even if every draft token were accepted.

    k drafts then cost k draft steps (one catch-up of 1 token, k - 1 chain steps) plus a verify pass of
    k + 1 tokens and yield k + 1 tokens; plain decoding yields 1 token per ``target(1)``.
    """
    if costs.draft is None:
        return False, 0.0
    best = 0.0
    for k in range(1, max_k + 1):
        seconds = costs.target(k + 1) + costs.draft(1) * k
        best = max(best, (k + 1) / seconds * costs.target(1))
    return best > 1.0, best


def open_runtime(path: str, settings: Settings, max_sequences: int, self_check: bool = True) -> ModelRuntime:
    """A llama.cpp runtime for ``settings``; ``self_check=False`` for a draft model (see LlamaCppRuntime)."""
    from specserve.backends.llama_cpp import LlamaCppRuntime

    capacity = max(512, settings.prefill_chunk + max_sequences * (settings.num_draft_tokens + 1))
    return LlamaCppRuntime(
        path,
        context_per_sequence=settings.context_size,
        max_sequences=max_sequences,
        n_threads=settings.threads,
        exact=settings.exact,
        batch_capacity=capacity,
        n_gpu_layers=settings.gpu_layers,
        self_check=self_check,
    )


def build_engine(settings: Settings, calibrate_costs: bool = True) -> tuple[SpeculativeEngine, BuildReport]:
    """Load everything ``settings`` asks for. Raises on a bad target; a bad draft degrades unless required."""
    from specserve.models import ModelStore

    started = time.perf_counter()
    report = BuildReport()
    store = ModelStore(None if settings.model_dir is None else Path(settings.model_dir))
    target_path = store.resolve(settings.target)
    report.target_path = str(target_path)
    target = open_runtime(str(target_path), settings, settings.max_running)
    if settings.exact and target.info.exactness == "capped":
        report.notes.append(
            f"exact mode capped at {target.info.max_verify_tokens}-row calls: {target.info.exactness_note}"
        )
    calib_dir = store.cache_dir / "calibration" if settings.calibration_cache else None
    key = calibration_key(settings, target)

    def measure(runtime: ModelRuntime) -> StepCostTable:
        return cached_calibration(runtime, 0, calib_dir, key) if calibrate_costs else flat_costs()

    costs = CostModel(measure(target))

    draft_runtime = None
    if _wants_draft(settings):
        draft_runtime = _load_draft(settings, store, target, target_path, costs, report, measure)
    context = DrafterContext(draft_runtime, settings.ngram_min_n, settings.draft_p_min)
    drafters: dict[str, Drafter] = {"ngram": build_drafter("ngram", context)}
    if draft_runtime is not None:
        drafters["draft-model"] = build_drafter("draft-model", context)
    report.drafters = list(drafters)
    policy: DraftLengthPolicy = (
        CostAwarePolicy(costs, rows_per_call=exact_rows(target))
        if settings.draft_policy == "cost"
        else FixedLengthPolicy()
    )
    names = tuple(drafters) if settings.drafter in ("auto", "none") else (settings.drafter,)
    options = EngineOptions(
        drafters=names,
        num_draft_tokens=settings.num_draft_tokens,
        speculation_enabled=settings.drafter != "none",
    )
    engine = SpeculativeEngine(
        target, drafters, policy, costs, options, settings.prefill_chunk, build_prefix_cache(settings, target)
    )
    report.seconds = time.perf_counter() - started
    return engine, report


def _requires_draft(settings: Settings) -> bool:
    return settings.load_draft == "always" or settings.drafter == "draft-model"


def _wants_draft(settings: Settings) -> bool:
    """Load a draft model when one is named and may be used: required, or left to the cost model (auto)."""
    if settings.draft_path_or_none is None:
        return False
    return _requires_draft(settings) or (settings.load_draft == "auto" and settings.drafter == "auto")


def _load_draft(
    settings: Settings,
    store: ModelStore,
    target: ModelRuntime,
    target_path: Path,
    costs: CostModel,
    report: BuildReport,
    measure: Callable[[ModelRuntime], StepCostTable],
) -> ModelRuntime | None:
    """The draft runtime, calibrated into ``costs``; None (degraded, or it cannot pay) where allowed."""
    from specserve.models import ModelStoreError, check_draft_compatible, read_vocab

    assert settings.draft_path_or_none is not None
    try:
        draft_path = store.resolve(settings.draft_path_or_none)
        check_draft_compatible(read_vocab(target_path), read_vocab(draft_path))
        draft_runtime = open_runtime(str(draft_path), settings, settings.max_running, self_check=False)
        costs.draft = measure(draft_runtime)
        report.draft_path = str(draft_path)
    except Exception as exc:
        if _requires_draft(settings):
            target.close()
            demand = "load_draft=always" if settings.load_draft == "always" else "drafter=draft-model"
            raise ModelStoreError(
                f"the draft model is required ({demand}) but could not be loaded: {exc}; "
                "fix it, or allow a start without it (load_draft=auto with drafter=auto)"
            ) from exc
        report.degraded = True
        report.notes.append(f"draft model not loaded: {exc}")
        log.warning("draft model not loaded, continuing without it: %s", exc)
        return None
    if _requires_draft(settings):
        return draft_runtime
    pays, best = draft_model_can_pay(costs, min(settings.num_draft_tokens, target.info.max_verify_tokens - 1))
    if pays:
        return draft_runtime
    note = (
        f"draft model unloaded: even at 100% acceptance it would reach {best:.2f}x plain speed "
        f"(target 1 token {costs.target(1) * 1000:.1f} ms, draft 1 token "
        f"{costs.draft(1) * 1000 if costs.draft else 0:.1f} ms)"
    )
    report.notes.append(note)
    log.info(note)
    draft_runtime.close()
    costs.draft, report.draft_path = None, None
    return None


def calibration_key(settings: Settings, target: ModelRuntime) -> dict[str, object]:
    """What a cached cost calibration depends on besides the model file (see ``cached_calibration``)."""
    return {
        "threads": target.info.n_threads,
        "exact": settings.exact,
        "exactness": target.info.exactness,
        "gpu_layers": settings.gpu_layers,
        "context": target.info.context_per_sequence,
    }


def build_prefix_cache(settings: Settings, target: ModelRuntime) -> PrefixCache | None:
    """The prefix cache the settings ask for; in capped exact mode only whole prefill chunks are reusable."""
    if not settings.prefix_cache:
        return None
    grid = settings.prefill_chunk if target.info.exactness == "capped" else None
    return PrefixCache(target, host_bytes=settings.prefix_cache_ram << 20, grid=grid)


def exact_rows(target: ModelRuntime) -> int | None:
    """Rows per llama_decode call in capped exact mode (the policy's cost of a step depends on it); None
    where a step is one call whatever its size."""
    return target.info.max_verify_tokens if target.info.exactness == "capped" else None


def flat_costs() -> StepCostTable:
    """Uncalibrated costs (tests, plain-only runs): every extra token costs as much as the first
    (GPU-like optimism off)."""
    return StepCostTable.from_samples({1: 1.0, 64: 64.0})
