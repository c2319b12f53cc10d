"""Tiny random DFlash2 / DFlash checkpoints in the published layout, built by the reference package.

The model is the ``dflash`` package's own ``DFlash2DraftModel`` (or ``DFlashDraftModel``) on a Qwen3
config, its weights redrawn (the package leaves the convolution kernels uninitialised), saved as the
published checkpoints are: ``config.json`` with ``architectures`` and ``dflash_config``, one
``model.safetensors``, the selector codebooks named without ``.weight``. ``reference_model`` loads such a
directory back with the package's ``from_pretrained``, so a test compares our forward with theirs on the
same files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def write_tiny_dflash(
    directory: Path,
    *,
    vocab_size: int,
    version: int = 2,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_target_layers: int = 2,
    target_layer_ids: tuple[int, ...] = (0, 1),
    block_size: int = 4,
    top_k: int = 8,
    mask_token_id: int = 0,
    seed: int = 0,
    softcap: float | None = None,
) -> Path:
    """Write a random drafter into ``directory`` (overwritten) and return it."""
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    dflash: dict[str, Any] = {
        "block_size": block_size,
        "target_layer_ids": list(target_layer_ids),
        "mask_token_id": mask_token_id,
        "output_multiplier": 1.0,
        "final_logit_softcapping": softcap,
    }
    if version == 2:
        dflash |= {"selector_rank": 8, "selector_top_k": top_k, "conv_kernel_size": 2, "conv_group_size": 16}
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.num_target_layers = num_target_layers
    config.dflash_config = dflash
    config.architectures = ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"]
    torch.manual_seed(seed)
    model = (DFlash2DraftModel if version == 2 else DFlashDraftModel)(config).float().eval()
    inv = 1.0 / math.sqrt(hidden_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "base_kernel" in name:
                param.normal_(0.0, 0.3)
                param[:, 0] += 1.0  # near identity: a position mostly keeps itself
            elif "codebook" in name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 2.0 * inv)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        (k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k): v.contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict()
    raw["architectures"] = config.architectures
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    return directory


def reference_model(directory: Path) -> Any:
    """The ``dflash`` package's model loaded from ``directory`` with its own ``from_pretrained``."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    cls = DFlash2DraftModel if architecture == "DFlash2DraftModel" else DFlashDraftModel
    return cls.from_pretrained(str(directory), dtype="float32").eval()
