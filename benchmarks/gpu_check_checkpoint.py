"""A random decoder written as a Hugging Face checkpoint directory, for the GPU check's ``serve`` section.

The server's default engine runs in a process of its own and loads its target from a path, so the check's
in-memory model goes to disk first: ``config.json``, ``model.safetensors`` (the fused q/k/v and gate/up
matrices split back into Hugging Face's names, the tied head left out) and a ``tokenizer.json`` whose
vocabulary is the model's: word-level tokens ``t0`` … ``t{V-1}``, so any id the random model emits
detokenizes (the check sends prompts of token ids). ``tests/benchmarks/test_gpu_check.py`` loads it back
through the torch runtime and compares logits with the model it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.backends.torch.model import Decoder

_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def write_checkpoint(model: Decoder, directory: Path) -> Path:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(model), indent=2))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in hf_tensors(model)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def hf_config(model: Decoder) -> dict[str, Any]:
    c = model.config
    config: dict[str, Any] = {
        "architectures": [_MODEL_TYPES[c.family]],
        "model_type": c.family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "torch_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
    }
    if c.rope_scaling is not None:
        s = c.rope_scaling
        config["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            config["rope_scaling"].update(
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position,
            )
    return config


def hf_tensors(model: Decoder) -> list[tuple[str, torch.Tensor]]:
    """The decoder's parameters under Hugging Face's names (weights.py's ``_model_name`` read backwards)."""
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.named_parameters():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if not name.startswith("layers."):
            out.append((name if name.startswith("lm_head") else f"model.{name}", tensor))
            continue
        _, layer, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        prefix = f"model.layers.{layer}"
        if module == "qkv_proj":
            for part, piece in zip("qkv", torch.split(tensor, [q, kv, kv]), strict=True):
                out.append((f"{prefix}.self_attn.{part}_proj.{kind}", piece))
        elif module == "gate_up_proj":
            for part, piece in zip(("gate", "up"), torch.chunk(tensor, 2), strict=True):
                out.append((f"{prefix}.mlp.{part}_proj.{kind}", piece))
        elif module in ("o_proj", "q_norm", "k_norm"):
            out.append((f"{prefix}.self_attn.{module}.{kind}", tensor))
        elif module == "down_proj":
            out.append((f"{prefix}.mlp.down_proj.{kind}", tensor))
        else:  # input_layernorm, post_attention_layernorm
            out.append((f"{prefix}.{module}.{kind}", tensor))
    return out
