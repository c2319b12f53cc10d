"""Weights for the torch decoder, named as in Hugging Face checkpoints, from either kind of file.

* A Hugging Face checkpoint directory: ``config.json`` and ``*.safetensors`` (one file, or shards listed in
  ``model.safetensors.index.json``), read tensor by tensor.
* A GGUF file (what specserve's model store holds): every tensor dequantized by ggml's own code
  (``ggml_dequantize.py``; the ``gguf`` package's numpy port where llama.cpp's library is missing: Q4_K,
  Q5_K, Q6_K, Q8_0, Q5_0, F16, F32 ...) and renamed. llama.cpp's Llama converter permutes the rows
  of q and k so that its interleaved RoPE equals Hugging Face's rotate-half RoPE; the permutation is undone
  here (Qwen files use llama.cpp's NeoX RoPE and are not permuted).

Tensors are cast to the runtime's dtype and moved to its device one at a time, so peak host memory is one
tensor in float32 beyond the model itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from specserve.backends.torch.config import from_gguf_metadata, from_hf_config

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output.bias": "lm_head.bias",
}
ROPE_FREQS = "rope_freqs.weight"
"""Llama 3.1's RoPE scaling as per-pair frequency divisors (GGUF only); not a model weight."""


def gguf_tensor_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``; None for a tensor not mapped."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        mapped = _GGUF_LAYER_NAMES.get(rest)
        return f"model.layers.{layer}.{mapped}" if mapped else None
    return None


def unpermute_rope_rows(
    weight: np.ndarray[Any, Any],  # [heads * head_dim, ...] float32, rows as llama.cpp's converter left them
    heads: int,
) -> np.ndarray[Any, Any]:  # same shape, rows in Hugging Face order
    """Undo ``convert_hf_to_gguf``'s Llama q/k permutation: per head, rows ``[0, 2, 4, ..., 1, 3, 5, ...]``
    of the interleaved layout go back to the two halves rotate-half RoPE expects.

    Example (one head of 4 rows): rows ``[a0, b0, a1, b1]`` (interleaved pairs) → ``[a0, a1, b0, b1]``.
    """
    head_dim = weight.shape[0] // heads
    rest = weight.shape[1:]
    return weight.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


class GGUFWeights:
    """A GGUF file opened for the torch runtime: its config and its tensors as float32 numpy arrays.

    The header is read with specserve's own parser, keeping only the model's scalar keys (the gguf
    package's reader decodes all 150k token strings first: seconds for nothing); tensor data is mapped
    from the file and dequantized one tensor at a time.
    """

    def __init__(self, path: Path) -> None:
        from specserve.models.gguf_header import read_header

        self.path = path
        arch_key = "general.architecture"
        arch = read_header(path, keys=(arch_key,)).metadata.get(arch_key)
        header = read_header(path, keys=[arch_key, *(f"{arch}.{k}" for k in _GGUF_MODEL_KEYS)])
        self._data_offset = header.data_offset
        self._tensors = {t.name: t for t in header.tensors}
        if "token_embd.weight" not in self._tensors:
            raise ValueError("no token_embd.weight tensor: not a decoder GGUF")
        vocab = int(self._tensors["token_embd.weight"].shape[1])
        self.config = from_gguf_metadata(header.metadata, set(self._tensors), vocab)

    def rope_freqs(self) -> np.ndarray[Any, Any] | None:  # [head_dim // 2] float32
        return self._array(ROPE_FREQS) if ROPE_FREQS in self._tensors else None

    def __iter__(self) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        for name in self._tensors:
            hf_name = gguf_tensor_name(name)
            if hf_name is not None:
                yield hf_name, self._oriented(name, self._array(name))

    def _oriented(self, name: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Undo the Llama converter's q/k row permutation (see the module docstring)."""
        config = self.config
        if config.family == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rope_rows(array, config.num_heads)
        if config.family == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rope_rows(array, config.num_kv_heads)
        return array

    def _array(self, name: str) -> np.ndarray[Any, Any]:
        """One tensor dequantized to float32, in numpy (row-major, Hugging Face) shape."""
        import gguf

        from specserve.backends.ggml_dequantize import to_float32

        info = self._tensors[name]
        offset = self._data_offset + info.offset
        raw = np.memmap(self.path, np.uint8, "r", offset=offset, shape=(info.n_bytes,))
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        shape = tuple(reversed(info.shape))  # ggml lists the fastest dimension first
        if qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)  # read-only: copied when loaded
        if qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).astype(np.float32).reshape(shape)
        values = to_float32(raw, info.ggml_type, int(np.prod(shape)))
        if values is not None:
            return values.reshape(shape)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = raw.reshape(-1, info.shape[0] // block_size * type_size)
        return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


_GGUF_MODEL_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
)


class HFWeights:
    """A Hugging Face checkpoint directory: its ``config.json`` and its safetensors tensors."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config = from_hf_config(json.loads((directory / "config.json").read_text()))
        self.files = safetensors_files(directory)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """(name, torch tensor) pairs; Qwen3/Llama checkpoints may carry a ``model.`` prefix only."""
        return read_safetensors(self.files)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint directory: the shards its index lists, else every *.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    return files


def read_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(name, torch tensor) pairs of ``files``, file after file, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() but no iteration
                yield name, f.get_tensor(name)


def open_weights(path: Path) -> GGUFWeights | HFWeights:
    """The weights at ``path``: a checkpoint directory or a GGUF file."""
    return HFWeights(path) if path.is_dir() else GGUFWeights(path)


_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {"mlp.down_proj": "down_proj", "self_attn.o_proj": "o_proj"}
_RENAMED_NORMS = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}


def load_decoder(source: GGUFWeights | HFWeights, dtype: Any, device: Any, positions: int) -> Any:
    """A :class:`~specserve.backends.torch.model.Decoder` holding ``source``'s weights in ``dtype`` on
    ``device``; q/k/v and gate/up are fused into one matrix each as they arrive."""
    import torch

    from specserve.backends.torch.model import Decoder

    config = source.config
    with torch.device("meta"):
        model = Decoder(config).to(dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    pending: dict[str, list[Any]] = {}
    loaded: set[str] = set()
    for name, array in source:
        tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(_writable(array))
        target, part, parts = _model_name(name)
        if target is None:
            continue
        if parts > 1:
            pieces = pending.setdefault(target, [None] * parts)
            pieces[part] = tensor
            if any(p is None for p in pieces):
                continue
            tensor = torch.cat(pending.pop(target), dim=0)
        if target not in params:
            raise ValueError(f"{name}: no such weight in a {config.family} decoder of this shape")
        with torch.no_grad():
            params[target].copy_(tensor.reshape(params[target].shape))
        loaded.add(target)
    if config.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded - {"lm_head.weight"})
    if missing or pending:
        raise ValueError(f"the checkpoint lacks {', '.join(missing + sorted(pending))[:300]}")
    freqs = source.rope_freqs() if isinstance(source, GGUFWeights) else None
    model.set_rope_table(positions, None if freqs is None else [float(f) for f in freqs])
    return model.eval()


def _writable(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """F32 tensors come straight from the read-only file map; torch wants memory it may write."""
    return array if array.flags.writeable else array.copy()


def _model_name(name: str) -> tuple[str | None, int, int]:
    """A checkpoint name → (the decoder's parameter, which part of a fused matrix, how many parts).

    Example: ``model.layers.0.self_attn.k_proj.bias`` → ``("layers.0.qkv_proj.bias", 1, 3)``.
    """
    if name.startswith("model."):
        name = name[len("model.") :]
    if not name.startswith("layers."):
        return (
            (
                name
                if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight", "lm_head.bias")
                else None
            ),
            0,
            1,
        )
    _, layer, rest = name.split(".", 2)
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", part, 3 if fused == "qkv_proj" else 2
    module = _RENAMED.get(module) or _RENAMED_NORMS.get(module) or module
    return f"layers.{layer}.{module}.{kind}", 0, 1
