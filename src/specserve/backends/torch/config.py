"""The shape of a decoder: one typed config for every family the torch runtime runs, from either source.

Qwen2/Qwen2.5, Qwen3 and Llama 3 are the same decoder with three switches: q/k/v biases (Qwen2), per-head
q/k RMSNorm (Qwen3), and RoPE frequency scaling (Llama 3.1+). A Hugging Face ``config.json`` and a GGUF
file's metadata describe the same facts under different names; both end here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["qwen2", "qwen3", "llama"]
FAMILIES: tuple[Family, ...] = ("qwen2", "qwen3", "llama")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this runtime does not implement (family, RoPE scaling)."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (``rope_type: llama3``), or linear position scaling."""

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the model math needs; weights are named as in Hugging Face checkpoints."""

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    """q/k/v projections carry biases (always in Qwen2; a config switch in Llama)."""
    qk_norm: bool
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    rope_scaling: RopeScaling | None = None
    lm_head_bias: bool = False
    """The LM head adds a bias (no published family; specserve's tiny test GGUFs fix special logits so)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads"
            )


def from_hf_config(config: Mapping[str, Any]) -> DecoderConfig:
    """A ``config.json`` of a Qwen2, Qwen3 or Llama checkpoint."""
    family = config.get("model_type")
    if family == "mistral":  # the Llama decoder under another name
        family = "llama"
    if family not in FAMILIES:
        known = ", ".join(FAMILIES)
        raise UnsupportedModelError(f"model_type {family!r} is not supported by the torch runtime ({known})")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    # transformers 5 moved rope_theta and rope_scaling into one rope_parameters dict.
    rope = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    return DecoderConfig(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        max_position=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        rope_scaling=_hf_rope_scaling(scaling),
    )


def _hf_rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported by the torch runtime")


def from_gguf_metadata(meta: Mapping[str, Any], tensor_names: set[str], vocab_size: int) -> DecoderConfig:
    """GGUF metadata (``general.architecture`` and ``<arch>.*`` keys) of a qwen2, qwen3 or llama file.

    A file without ``output.weight`` ties its head to the embedding. Llama 3.1 GGUFs carry their RoPE
    scaling as a ``rope_freqs`` tensor instead of metadata; the weight loader applies it.
    """
    arch = meta.get("general.architecture")
    if arch not in FAMILIES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported by the torch runtime")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif kind not in ("none", None):  # YaRN and others: llama.cpp would apply them, so refuse, not ignore
        raise UnsupportedModelError(f"GGUF RoPE scaling {kind!r} is not supported by the torch runtime")
    return DecoderConfig(
        family=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10_000.0)),
        max_position=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rope_scaling=scaling,
        lm_head_bias="output.bias" in tensor_names,
    )


def rope_inverse_frequencies(config: DecoderConfig) -> list[float]:
    """``1 / theta^(2i / head_dim)`` for each rotated pair, with the config's scaling applied."""
    dim = config.head_dim
    inv = [1.0 / config.rope_theta ** (2 * i / dim) for i in range(dim // 2)]
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return [f / scaling.factor for f in inv]
    # Llama 3: long wavelengths are slowed by the factor, short ones kept, the band between interpolated.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    scaled = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            scaled.append(f)
        elif wavelen > low_wavelen:
            scaled.append(f / scaling.factor)
        else:
            smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            scaled.append((1 - smooth) * f / scaling.factor + smooth * f)
    return scaled
