"""The settings of a DFlash / DFlash2 block-drafter checkpoint, read from its ``config.json`` (no torch).

A published checkpoint (``z-lab/*-DFlash2``) is a Hugging Face directory whose ``config.json`` has
``architectures: ["DFlash2DraftModel"]`` (or ``["DFlashDraftModel"]`` for the first version, without the
candidate selector and the convolutions), a Qwen3 decoder's fields, ``num_target_layers``, and the drafter's
own fields under ``dflash_config``. It is recognised by that architecture, as vLLM does, so ``--draft PATH``
takes it as well as a draft model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.models.errors import ModelStoreError

ARCHITECTURES = {"DFlash2DraftModel": 2, "DFlashDraftModel": 1}
"""The ``config.json`` architectures of block drafters → their DFlash version."""


@dataclass(frozen=True)
class BlockDrafterConfig:
    """One block drafter's shape and its ``dflash_config``."""

    version: int  # 1: DFlash, 2: DFlash2 (candidate selector and dynamic convolutions)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool
    num_target_layers: int
    block_size: int
    """Positions of one drafting forward, the anchor included: it drafts ``block_size - 1`` tokens."""
    target_layer_ids: tuple[int, ...]
    """The target layers whose outputs, concatenated, are the context features (0-based layer index)."""
    mask_token_id: int
    selector_rank: int = 0
    selector_top_k: int = 0
    """Candidates per block position the selector walks (DFlash2)."""
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def as_json(self) -> dict[str, Any]:
        """``config.json`` in the published layout (what ``read_block_drafter_config`` reads back)."""
        dflash: dict[str, Any] = {
            "block_size": self.block_size,
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping,
        }
        if self.version == 2:
            dflash |= {
                "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k,
                "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size,
            }
        name = next(a for a, v in ARCHITECTURES.items() if v == self.version)
        return {
            "architectures": [name],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "num_target_layers": self.num_target_layers,
            "tie_word_embeddings": False,
            "dflash_config": dflash,
        }


def default_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread from layer 1 to layer L − 3: the upstream default when a config
    names none (one layer: the middle one)."""
    if count == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    ids = (round(1 + i * span / (count - 1)) for i in range(count))
    return tuple(sorted({max(0, min(num_target_layers - 1, i)) for i in ids}))


def is_block_drafter(path: Path | str) -> bool:
    """Whether ``path`` is a checkpoint directory of a DFlash or DFlash2 drafter."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        architectures = json.loads(file.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(a in ARCHITECTURES for a in architectures)


def read_block_drafter_config(path: Path | str) -> BlockDrafterConfig:
    """The drafter of checkpoint directory ``path``; ModelStoreError (one line) if it is not one."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
        version = next(ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in ARCHITECTURES)
        return _parse(raw, version)
    except StopIteration:
        raise ModelStoreError(f"{path}: config.json names no DFlash or DFlash2 architecture") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelStoreError(f"{path}: not a readable DFlash checkpoint config ({exc!r})") from None


def _parse(raw: dict[str, Any], version: int) -> BlockDrafterConfig:
    dflash = raw.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:  # dflash_config first, then the top level
        found = dflash.get(name, raw.get(name, default))
        if found is None and default is None:
            raise KeyError(name)
        return found

    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or raw.get("use_sliding_window"):
        raise ValueError("sliding-window drafter layers are not supported")
    if raw.get("is_causal"):
        raise ValueError("causal drafter layers are not supported (DFlash blocks are bidirectional)")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"RoPE type {rope.get('rope_type')!r} is not supported (default RoPE only)")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    softcap = dflash.get("final_logit_softcapping", raw.get("final_logit_softcapping"))
    config = BlockDrafterConfig(
        version=version,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        vocab_size=int(raw["vocab_size"]),
        attention_bias=bool(raw.get("attention_bias", False)),
        num_target_layers=int(raw["num_target_layers"]),
        block_size=int(value("block_size", 16)),
        target_layer_ids=tuple(
            int(i)
            for i in dflash.get("target_layer_ids")
            or raw.get("target_layer_ids")
            or default_layer_ids(int(raw["num_target_layers"]), layers)
        ),
        mask_token_id=int(value("mask_token_id")),
        selector_rank=int(value("selector_rank")) if version == 2 else 0,
        selector_top_k=int(value("selector_top_k")) if version == 2 else 0,
        conv_kernel_size=int(value("conv_kernel_size")) if version == 2 else 0,
        conv_group_size=int(value("conv_group_size")) if version == 2 else 0,
        output_multiplier=float(value("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
    )
    if config.block_size < 2:
        raise ValueError(f"block_size {config.block_size}: a block drafts block_size - 1 >= 1 tokens")
    if not config.target_layer_ids:
        raise ValueError("target_layer_ids is empty")
    if config.version == 2 and config.hidden_size % config.conv_group_size:
        raise ValueError(f"conv_group_size {config.conv_group_size} does not divide {config.hidden_size}")
    return config
