"""``specserve train-drafter``: train a DFlash2 drafter for the loaded target, resumably.

Steps: the dataset (generated once, ``data.pt``); a new drafter (or the checkpoint and optimizer state
of an earlier run in the same directory, ``--resume``); AdamW with warm-up and cosine decay over the
examples in random order, a few anchors each; a checkpoint in the published layout every
``checkpoint_every`` steps and at the end (``config.json`` + ``model.safetensors``, loadable by
``--draft DIR``), the training state beside it (``training_state.pt``). The held-out examples (the last
``holdout`` share) measure the acceptance length before and after, written to ``training.json``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.backends.torch.dflash2 import BlockDrafterNet, TargetFeatures
from specserve.backends.torch.dflash2_files import load_block_drafter, save_block_drafter
from specserve.models.block_drafter import BlockDrafterConfig, default_layer_ids, read_block_drafter_config
from specserve.tools.train_drafter.data import generate_examples, load_examples, read_prompts, save_examples
from specserve.tools.train_drafter.objective import (
    Objective,
    acceptance_length,
    example_loss,
    new_drafter,
    sample_anchors,
)
from specserve.tools.workloads import ToolInputError


@dataclass(frozen=True)
class TrainOptions:
    prompts: Path
    output_dir: Path
    steps: int = 1000
    time_limit: float = 0.0
    """Seconds of training (0: no limit); the run stops, checkpointed, when it is up."""
    block_size: int = 16
    layers: int = 1
    target_layers: int = 3
    """How many target layers feed the context (spread as upstream does)."""
    target_layer_ids: tuple[int, ...] = ()
    """Or exactly these."""
    top_k: int = 16
    selector_rank: int = 64
    anchors: int = 8
    gamma: float = 7.0
    lr: float = 6e-4
    warmup: int = 20
    max_new_tokens: int = 128
    temperature: float = 0.0
    holdout: float = 0.1
    checkpoint_every: int = 100
    resume: bool = True
    seed: int = 0


def train_drafter(target: Any, options: TrainOptions, log: Any = print) -> dict[str, Any]:
    """Train into ``options.output_dir``; returns the run's summary (also written to training.json)."""
    out = options.output_dir
    out.mkdir(parents=True, exist_ok=True)
    state_file = out / "training_state.pt"
    resumed = options.resume and state_file.is_file() and (out / "config.json").is_file()
    config = read_block_drafter_config(out) if resumed else _config(target, options)
    features = TargetFeatures(target.model, config.target_layer_ids)
    data_file = out / "data.pt"
    recorded_with = {"target_layer_ids": list(config.target_layer_ids), "target": target.info.path}
    if data_file.is_file():
        examples, found = load_examples(data_file)
        if found != recorded_with:
            raise ToolInputError(
                f"{data_file} was recorded with {found}, this drafter reads {recorded_with}: delete it, or "
                "use another --output-dir"
            )
    else:
        prompts = read_prompts(options.prompts)
        started = time.perf_counter()
        examples = generate_examples(
            target, features, prompts, options.max_new_tokens, options.temperature, _progress(log, "generate")
        )
        save_examples(examples, data_file, recorded_with)
        log(f"generated {len(examples)} responses in {time.perf_counter() - started:.0f} s")
    held = max(1, round(len(examples) * options.holdout))
    if len(examples) < 2:
        raise ToolInputError("train-drafter needs at least 2 usable responses (more prompts?)")
    train, heldout = examples[:-held], examples[-held:]
    # An anchor needs a whole block of response after it; shorter responses train nothing.
    train = [e for e in train if e.tokens.shape[0] - config.block_size >= e.prompt_len]
    if not train:
        raise ToolInputError(f"no training response is longer than the block ({config.block_size} tokens)")
    device = target.device
    embed, head = target.model.embed_tokens, target.model.lm_head
    for p in target.model.parameters():
        p.requires_grad_(False)
    if resumed:
        net = load_block_drafter(out, target.config, torch.float32, device).train()
    else:
        net = new_drafter(target.model, config, options.seed).to(device).train()
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=options.lr)
    step, summary = 0, {}
    if resumed:
        saved = torch.load(state_file, weights_only=False)
        step, summary = int(saved["step"]), dict(saved["summary"])
        weights_step = json.loads((out / "config.json").read_text()).get("training_step")
        if weights_step != step:  # a crash between the two writes of a checkpoint
            raise ToolInputError(
                f"{out}: the weights are from step {weights_step}, the optimizer state from step {step}; "
                "start over with --no-resume"
            )
        optimizer.load_state_dict(saved["optimizer"])
    objective = Objective(config.block_size, options.anchors, options.gamma)
    autocast = torch.autocast(device.type, dtype=target.dtype, enabled=target.dtype != torch.float32)
    if "acceptance_before" not in summary:
        with autocast:
            summary["acceptance_before"] = acceptance_length(
                net.eval(), embed, head, heldout, config.block_size
            )
        net.train()
        log(f"held-out acceptance length before training: {summary['acceptance_before']:.3f}")
    generator = torch.Generator().manual_seed(options.seed + step)
    started, last = time.perf_counter(), dict[str, float]()
    from tqdm import tqdm

    bar = tqdm(total=options.steps, initial=step, desc="train-drafter", unit="step", mininterval=5.0)
    while step < options.steps:
        if options.time_limit and time.perf_counter() - started > options.time_limit:
            break
        example = train[int(torch.randint(len(train), (1,), generator=generator))]
        anchors = sample_anchors(example, options.anchors, config.block_size, generator)
        if anchors is None:
            continue
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(options, step)
        with autocast:
            loss, last = example_loss(net, embed, head, example, anchors.to(device), objective)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in last.items()})
        if step % options.checkpoint_every == 0:
            _checkpoint(net, optimizer, step, summary, out)
    bar.close()
    with autocast:
        summary["acceptance_after"] = acceptance_length(net.eval(), embed, head, heldout, config.block_size)
    summary |= {
        "steps": step,
        "train_examples": len(train),
        "heldout_examples": len(heldout),
        "train_tokens": sum(int(e.tokens.shape[0]) for e in train),
        "last_losses": last,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
    }
    summary.setdefault("seconds", 0.0)
    summary["seconds"] += time.perf_counter() - started
    _checkpoint(net, optimizer, step, summary, out)
    (out / "training.json").write_text(json.dumps(summary, indent=2, default=str))
    log(
        f"held-out acceptance length: {summary['acceptance_before']:.3f} before, "
        f"{summary['acceptance_after']:.3f} after {step} steps"
    )
    return summary


def _config(target: Any, o: TrainOptions) -> BlockDrafterConfig:
    t = target.config
    ids = o.target_layer_ids or default_layer_ids(t.num_layers, o.target_layers)
    if not all(0 <= i < t.num_layers for i in ids):
        raise ToolInputError(f"--target-layer-ids {list(ids)}: the target has layers 0 … {t.num_layers - 1}")
    if t.hidden_size % 16:
        raise ToolInputError(f"hidden size {t.hidden_size}: the convolution groups need a multiple of 16")
    return BlockDrafterConfig(
        version=2,
        hidden_size=t.hidden_size,
        num_layers=o.layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        intermediate_size=t.intermediate_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        vocab_size=t.vocab_size,
        attention_bias=t.attention_bias,
        num_target_layers=t.num_layers,
        block_size=o.block_size,
        target_layer_ids=tuple(ids),
        mask_token_id=t.vocab_size - 1,  # Qwen's vocabulary ends in padding rows no tokenizer emits
        selector_rank=o.selector_rank,
        selector_top_k=o.top_k,
        conv_kernel_size=2,
        conv_group_size=16,
    )


def _learning_rate(o: TrainOptions, step: int) -> float:
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _checkpoint(net: BlockDrafterNet, optimizer: Any, step: int, summary: dict[str, Any], out: Path) -> None:
    save_block_drafter(net, out, extra={"training_step": step})
    partial = out / "training_state.partial"
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "summary": summary}, partial)
    partial.replace(out / "training_state.pt")


def _progress(log: Any, what: str) -> Any:
    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            log(f"{what}: {done}/{total}")

    return report
