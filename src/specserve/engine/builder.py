"""Build engines from settings: resolve the models, load the runtimes, calibrate costs, build the drafters.

This is the one place where that happens. ``load_models`` loads; ``LoadedModels.engine`` makes an engine over
what was loaded — the server and ``generate`` make one (``build_engine``), the benchmark and the rollout tools
make one per configuration over the same runtimes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.config import DrafterName, PolicyChoice, Settings
from specserve.drafters.base import Drafter
from specserve.drafters.registry import DrafterContext, build_drafter
from specserve.engine.cost_model import CostModel, StepCostTable, cached_calibration
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.draft_policy import DraftLengthPolicy, FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.engine.prefix_cache import PrefixCache
from specserve.engine.runtimes import Runtime, open_runtime
from specserve.engine.step_log import StepLog

if TYPE_CHECKING:
    from specserve.models import ModelStore

log = logging.getLogger("specserve.builder")

DEFAULT_MARGIN = 0.03
"""How much faster than plain decoding a plan must look before the cost policy leaves plain decoding."""


@dataclass
class BuildReport:
    """What happened while building, for logs, ``/ready`` and metrics."""

    target_path: str = ""
    draft_path: str | None = None
    drafters: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    degraded: bool = False
    draft_pays: bool = False
    """Whether the draft model could beat plain decoding at 100 % acceptance (measured costs)."""
    draft_best_speedup: float = 0.0
    """Its best speed-up over plain decoding at 100 % acceptance (``draft_model_can_pay``)."""
    seconds: float = 0.0


@dataclass
class LoadedModels:
    """The runtimes, their measured costs and the drafters over them: what engines are made of."""

    settings: Settings
    target: Runtime
    draft: Runtime | None
    costs: CostModel
    drafters: dict[str, Drafter]
    report: BuildReport

    @property
    def max_draft_tokens(self) -> int:
        """The cap on draft tokens per step: the longest exact verify chunk minus its pending token."""
        return self.target.info.max_verify_tokens - 1

    def policy(self, kind: PolicyChoice = "cost", margin: float = DEFAULT_MARGIN) -> DraftLengthPolicy:
        """A fresh draft policy (its acceptance statistics start empty) priced by the target's packing."""
        if kind == "fixed":
            return FixedLengthPolicy()
        return CostAwarePolicy(self.costs, margin, self.target.call_rows)

    def engine(
        self,
        drafters: Iterable[str] | None = None,
        policy: DraftLengthPolicy | None = None,
        num_draft_tokens: int | None = None,
        prefix_cache: bool = False,
    ) -> SpeculativeEngine:
        """An engine over the loaded runtimes.

        ``drafters=None`` follows the settings (``auto`` and ``none`` keep every loaded drafter for
        per-request choice, ``none`` switching speculation off); a tuple names exactly the drafters to use
        (``()``: plain decoding). ``prefix_cache`` as the settings ask (the server's engine; tools run
        configurations side by side and must not share KV between them).
        """
        settings = self.settings
        if drafters is None:
            chosen = self.drafters
            chosen_names: tuple[str, ...]
            if settings.drafter in ("auto", "none"):
                chosen_names = tuple(self.drafters)
            else:
                chosen_names = (settings.drafter,)
            enabled = settings.drafter != "none"
        else:
            chosen_names = tuple(drafters)
            # "grammar" (forced tokens of constrained requests) is the engine's own, offered whenever
            # speculation is on: naming it alone runs speculation with no other drafter.
            chosen = {name: self.drafters[name] for name in chosen_names if name != "grammar"}
            enabled = bool(chosen_names)
        limit = settings.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        return SpeculativeEngine(
            self.target,
            chosen,
            policy or self.policy(settings.draft_policy),
            self.costs,
            EngineOptions(chosen_names, limit, speculation_enabled=enabled),
            settings.prefill_chunk,
            build_prefix_cache(settings, self.target) if prefix_cache else None,
        )

    def close(self) -> None:
        """Close the runtimes (engines made by :meth:`engine` share them; closing one closes them all)."""
        for runtime in (self.draft, self.target):
            if runtime is not None:
                runtime.close()


def build_engine(settings: Settings, calibrate_costs: bool = True) -> tuple[SpeculativeEngine, BuildReport]:
    """The engine the settings describe (the server's and ``generate``'s), with its build report."""
    models = load_models(settings, calibrate_costs)
    engine = models.engine(prefix_cache=True)
    if settings.step_log:
        engine.step_log = StepLog(settings.step_log)
    return engine, models.report


def load_models(settings: Settings, calibrate_costs: bool = True, keep_draft: bool = False) -> LoadedModels:
    """Load everything ``settings`` asks for. Raises on a bad target; a bad draft degrades unless required.

    A draft model that cannot pay is unloaded unless it is required or ``keep_draft`` (a tool that measures
    or checks it anyway); ``report.draft_pays`` says which. With ``keep_draft`` a named draft model that does
    not load is an error, not a degraded start: the tool's draft-model arm would silently not run.
    """
    from specserve.models import ModelStore

    started = time.perf_counter()
    report = BuildReport()
    store = ModelStore(None if settings.model_dir is None else Path(settings.model_dir))
    target_path = store.resolve(settings.target)
    report.target_path = str(target_path)
    target = open_runtime(str(target_path), settings, settings.max_running)
    draft = None
    try:
        if settings.exact and target.info.exactness == "capped":
            info = target.info
            report.notes.append(
                f"exact mode capped at {info.max_verify_tokens}-row calls: {info.exactness_note}"
            )
        elif settings.exact and target.info.exactness == "off":  # asked for, and not proved at load
            report.degraded = True
            report.notes.append(f"exact mode is off: {target.info.exactness_note}")
        if settings.compile:
            seconds = getattr(target, "compile_seconds", None)
            report.notes.append(
                f"row functions compiled (torch.compile) in {seconds:.1f} s"
                if seconds is not None
                else "compile applies to the torch runtime only (--backend torch): nothing compiled"
            )
        calib_dir = store.cache_dir / "calibration" if settings.calibration_cache else None
        key = calibration_key(settings, target)

        def measure(runtime: Runtime, tune_kernels: bool = False) -> StepCostTable:
            if not calibrate_costs:
                return flat_costs()
            return cached_calibration(runtime, 0, calib_dir, key, tune_kernels)

        costs = CostModel(measure(target, tune_kernels=True))
        block_dir = _block_drafter_dir(settings, store)
        _check_draft_kind(settings, block_dir)
        if block_dir is None and _wants_draft(settings, keep_draft):
            max_k = min(settings.num_draft_tokens, target.info.max_verify_tokens - 1)
            draft = _load_draft(settings, store, target_path, costs, report, measure, keep_draft, max_k)
        drafters = build_drafters(settings, draft, target.info.vocab_size, target.info.logits_device)
        if block_dir is not None and _wants_draft(settings, keep_draft):
            block = _load_block_drafter(settings, target, block_dir, report, keep_draft)
            drafters.update({block.name: block} if block is not None else {})
    except BaseException:
        for runtime in (draft, target):
            if runtime is not None:
                runtime.close()
        raise
    report.drafters = list(drafters)
    report.seconds = time.perf_counter() - started
    return LoadedModels(settings, target, draft, costs, drafters, report)


def build_drafters(
    settings: Settings,
    draft: Runtime | None,
    target_vocab_size: int | None = None,
    target_logits_device: str = "cpu",
) -> dict[str, Drafter]:
    """Every drafter the loaded models allow: n-gram and suffix always, the draft model when one is
    loaded."""
    context = DrafterContext(
        draft,
        settings.ngram_min_n,
        settings.draft_p_min,
        target_vocab_size,
        target_logits_device=target_logits_device,
        suffix_depth=settings.suffix_depth,
        suffix_factor=settings.suffix_factor,
        suffix_min_prob=settings.suffix_min_prob,
        suffix_cache_requests=settings.suffix_cache_requests,
        suffix_cache_tokens=settings.suffix_cache_tokens,
    )
    names: list[DrafterName] = ["ngram", "suffix"] if draft is None else ["ngram", "suffix", "draft-model"]
    return {name: build_drafter(name, context) for name in names}


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


def _requires_draft(settings: Settings) -> bool:
    return settings.load_draft == "always" or settings.drafter in ("draft-model", "dflash2")


def _block_drafter_dir(settings: Settings, store: ModelStore) -> Path | None:
    """``--draft DIR`` naming a DFlash2 / DFlash checkpoint (recognised by its config.json architecture)."""
    from specserve.models.block_drafter import is_block_drafter

    name = settings.draft_path_or_none
    if name is None or name in store.catalog or not is_block_drafter(Path(name).expanduser()):
        return None
    return Path(name).expanduser()


def _check_draft_kind(settings: Settings, block_dir: Path | None) -> None:
    """A drafter asked for by name needs the kind of model ``--draft`` names (else it would be missing)."""
    from specserve.models import ModelStoreError

    if settings.drafter == "dflash2" and block_dir is None:
        raise ModelStoreError(
            f"--drafter dflash2 needs --draft DIR naming a DFlash2 (or DFlash) checkpoint; "
            f"--draft is {settings.draft!r}"
        )
    if settings.drafter == "draft-model" and block_dir is not None:
        raise ModelStoreError(
            f"--drafter draft-model needs a draft model; --draft {block_dir} is a DFlash2 checkpoint "
            "(--drafter dflash2 or auto)"
        )


def _load_block_drafter(
    settings: Settings, target: Runtime, path: Path, report: BuildReport, keep_draft: bool
) -> Drafter | None:
    """The DFlash2 drafter over ``target``; None (degraded) where it may be missing."""
    from specserve.models import ModelStoreError

    context = DrafterContext(
        target_runtime=target,
        block_drafter_path=str(path),
        draft_block_size=settings.draft_block_size,
        candidate_topk=settings.candidate_topk,
    )
    try:
        drafter = build_drafter("dflash2", context)
    except Exception as exc:
        if keep_draft or _requires_draft(settings):
            raise ModelStoreError(f"the DFlash2 drafter at {path} could not be loaded: {exc}") from exc
        report.degraded = True
        report.notes.append(f"DFlash2 drafter not loaded: {exc}")
        log.warning("DFlash2 drafter not loaded, continuing without it: %s", exc)
        return None
    report.draft_path = str(path)
    return drafter


def _wants_draft(settings: Settings, keep_draft: bool) -> bool:
    """Load a draft model when one is named and may be used: required, kept for measuring, or left to the
    cost model (auto)."""
    if settings.draft_path_or_none is None:
        return False
    return (
        keep_draft
        or _requires_draft(settings)
        or (settings.load_draft == "auto" and settings.drafter == "auto")
    )


def _load_draft(
    settings: Settings,
    store: ModelStore,
    target_path: Path,
    costs: CostModel,
    report: BuildReport,
    measure: Callable[[Runtime], StepCostTable],
    keep_draft: bool,
    max_k: int,
) -> Runtime | None:
    """The draft runtime, calibrated into ``costs``; None (degraded, or it cannot pay) where allowed."""
    from specserve.models import ModelStoreError, check_draft_compatible, read_vocab

    assert settings.draft_path_or_none is not None
    try:
        draft_path = store.resolve(settings.draft_path_or_none)
        check_draft_compatible(read_vocab(target_path), read_vocab(draft_path))
        draft = open_runtime(str(draft_path), settings, settings.max_running, self_check=False)
        try:
            costs.draft = measure(draft)
        except BaseException:
            draft.close()
            raise
        report.draft_path = str(draft_path)
    except Exception as exc:
        if keep_draft:  # a tool that measures or checks the draft model: without it, it would lie
            raise ModelStoreError(
                f"the draft model's arm cannot run ({exc}); fix --draft, or give --draft none"
            ) from exc
        if _requires_draft(settings):
            demand = "load_draft=always" if settings.load_draft == "always" else "drafter=draft-model"
            raise ModelStoreError(
                f"the draft model is required ({demand}) but could not be loaded: {exc}; "
                "fix it, or allow a start without it (load_draft=auto with drafter=auto)"
            ) from exc
        report.degraded = True
        report.notes.append(f"draft model not loaded: {exc}")
        log.warning("draft model not loaded, continuing without it: %s", exc)
        return None
    report.draft_pays, best = draft_model_can_pay(costs, max_k)
    report.draft_best_speedup = best
    if report.draft_pays or _requires_draft(settings) or keep_draft:
        return draft
    note = (
        f"draft model unloaded: even at 100% acceptance it would reach {best:.2f}x plain speed "
        f"(target 1 token {costs.target(1) * 1000:.1f} ms, draft 1 token "
        f"{costs.draft(1) * 1000 if costs.draft else 0:.1f} ms)"
    )
    report.notes.append(note)
    log.info(note)
    draft.close()
    costs.draft, report.draft_path = None, None
    return None


def calibration_key(settings: Settings, target: Runtime) -> dict[str, object]:
    """What a cached cost calibration depends on besides the model file (see ``cached_calibration``)."""
    return {
        "backend": type(target).__name__,
        "description": target.info.description,
        "build": target.info.build,
        "threads": target.info.n_threads,
        "exact": settings.exact,
        "exactness": target.info.exactness,
        "gpu_layers": settings.gpu_layers,
        "context": target.info.context_per_sequence,
    }


def build_prefix_cache(settings: Settings, target: Runtime) -> PrefixCache | None:
    """The prefix cache the settings ask for; in capped exact mode only whole prefill chunks are reusable."""
    if not settings.prefix_cache:
        return None
    grid = settings.prefill_chunk if target.info.exactness == "capped" else None
    return PrefixCache(target, host_bytes=settings.prefix_cache_ram << 20, grid=grid)


def flat_costs() -> StepCostTable:
    """Uncalibrated costs (tests, plain-only runs): every extra token costs as much as the first
    (GPU-like optimism off)."""
    return StepCostTable.from_samples({1: 1.0, 64: 64.0})
