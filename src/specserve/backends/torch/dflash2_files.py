"""Block-drafter checkpoints on disk, in the published layout: ``config.json`` + ``model.safetensors`` (or
shards with ``model.safetensors.index.json``), the selector codebooks without ``.weight``.

``load_block_drafter`` checks the checkpoint against the target it will read from: the number of target
layers, the hidden size and the vocabulary must match, or it refuses in one line (a drafter trained for
another target would load and then draft garbage).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.backends.torch.config import DecoderConfig
from specserve.backends.torch.dflash2 import BlockDrafterNet, module_name, published_name
from specserve.backends.torch.weights import read_safetensors, safetensors_files
from specserve.models.block_drafter import BlockDrafterConfig, read_block_drafter_config
from specserve.models.errors import ModelStoreError


def check_matches_target(config: BlockDrafterConfig, target: DecoderConfig, path: Path | str) -> None:
    """Refuse (one line) a drafter whose target layer count, hidden size or vocabulary differ."""
    problems = []
    if config.num_target_layers != target.num_layers:
        problems.append(f"{config.num_target_layers} target layers, the target has {target.num_layers}")
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden size {config.hidden_size}, the target's is {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {config.vocab_size}, the target's is {target.vocab_size}")
    if not all(0 <= i < target.num_layers for i in config.target_layer_ids):
        problems.append(f"target_layer_ids {list(config.target_layer_ids)} outside the target's layers")
    if problems:
        raise ModelStoreError(f"{path}: the block drafter does not fit this target: {'; '.join(problems)}")


def load_block_drafter(
    path: Path | str, target: DecoderConfig, dtype: torch.dtype, device: torch.device
) -> BlockDrafterNet:
    """The drafter of checkpoint directory ``path`` for ``target``, on ``device`` in ``dtype``, eval mode."""
    directory = Path(path)
    config = read_block_drafter_config(directory)
    check_matches_target(config, target, directory)
    net = BlockDrafterNet(config)
    try:
        state = {module_name(name): tensor for name, tensor in read_safetensors(safetensors_files(directory))}
    except FileNotFoundError as exc:
        raise ModelStoreError(str(exc)) from None
    expected = set(net.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelStoreError(
            f"{directory}: weights do not match the DFlash{'2' if config.version == 2 else ''} layout "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(net.state_dict()[name].shape):
            raise ModelStoreError(f"{directory}: {name} has shape {list(tensor.shape)}")
    net.load_state_dict(state)
    return net.to(device=device, dtype=dtype).eval()


def save_block_drafter(
    net: BlockDrafterNet, directory: Path | str, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``net`` as a published checkpoint (float32 safetensors; ``extra`` merged into config.json)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {published_name(k): v.detach().float().contiguous().cpu() for k, v in net.state_dict().items()}
    partial = out / "model.safetensors.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    partial.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(net.config.as_json() | (extra or {}), indent=2))
    return out
