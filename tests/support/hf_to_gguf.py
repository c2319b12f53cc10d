"""A tiny Hugging Face checkpoint written as GGUF the way llama.cpp's converter writes it.

For the torch runtime's GGUF path: the same weights in both formats must give the same logits, and
llama.cpp itself must read the GGUF as the checkpoint means it (which checks the Llama q/k row permutation
``convert_hf_to_gguf.py`` applies, and that the loader undoes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from support.tiny_models import _add_tokenizer, tiny_vocab

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(weight: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows → llama.cpp's interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int, theta: float) -> np.ndarray[Any, Any]:
    """What the converter stores for Llama 3.1 scaling: a divisor per rotated pair (rope_freqs)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_to_gguf(checkpoint: Path, out: Path, weight_type: str = "f32") -> Path:
    """Write ``checkpoint`` (a tiny_hf directory) as ``out`` (GGUF, f32 or q8_0 matrices)."""
    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors |= load_file(str(file))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    _add_tokenizer(writer, tiny_vocab())
    if rope.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        writer.add_tensor(
            "rope_freqs.weight", _llama3_rope_factors(rope, head_dim, rope.get("rope_theta", 1e4))
        )
    for name, weight in tensors.items():
        weight = weight.astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{_LAYER[rest]}"
            if arch == "llama" and rest.startswith("self_attn.q_proj"):
                weight = _permute(weight, heads)
            elif arch == "llama" and rest.startswith("self_attn.k_proj"):
                weight = _permute(weight, kv_heads)
        if weight.ndim == 2 and weight_type == "q8_0":
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quantize(weight, qtype), raw_shape=None, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
