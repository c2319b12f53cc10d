"""``specserve train-drafter``: the parsed flags → the target on the torch runtime → a training run."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

from specserve.config_sources import load_settings
from specserve.tools.flags import parse_int_list
from specserve.tools.output import progress
from specserve.tools.workloads import ToolInputError

GENERATION_SLOTS = 16
"""Responses generated at once (a CPU's plain step over 16 rows costs about two one-row steps)."""


def train_drafter_command(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        raise ToolInputError("specserve train-drafter needs PyTorch: pip install 'specserve[torch]'")
    for flag in ("steps", "block_size", "layers", "target_layers", "top_k", "anchors"):
        if getattr(args, flag) < 1:
            raise ToolInputError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.block_size < 2:
        raise ToolInputError("--block-size must be >= 2 (a block drafts block size - 1 tokens)")
    from specserve.engine.runtimes import open_runtime
    from specserve.models import ModelStore
    from specserve.tools.train_drafter.loop import TrainOptions, train_drafter

    settings = load_settings(args, config_file=args.config)
    settings = dataclasses.replace(settings, backend="torch", exact=False, context_size=args.context)
    store = ModelStore(Path(settings.model_dir) if settings.model_dir else None)
    target = open_runtime(str(store.resolve(settings.target)), settings, GENERATION_SLOTS, self_check=False)
    ids = (
        tuple(parse_int_list(args.target_layer_ids, "--target-layer-ids", 0)) if args.target_layer_ids else ()
    )
    options = TrainOptions(
        prompts=Path(args.prompts),
        output_dir=Path(args.output_dir),
        steps=args.steps,
        time_limit=args.time_limit,
        block_size=args.block_size,
        layers=args.layers,
        target_layers=args.target_layers,
        target_layer_ids=ids,
        top_k=args.top_k,
        selector_rank=args.selector_rank,
        anchors=args.anchors,
        gamma=args.gamma,
        lr=args.lr,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        checkpoint_every=args.checkpoint_every,
        resume=not args.no_resume,
        seed=args.seed,
    )
    try:
        train_drafter(target, options, progress)
    finally:
        target.close()
    return 0
