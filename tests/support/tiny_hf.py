"""Tiny random Hugging Face checkpoints: what a GPU user downloads, in miniature, written in milliseconds.

Why: the torch runtime and the model store take a checkpoint directory (``config.json``, sharded
``*.safetensors`` with their index, ``tokenizer.json``, ``tokenizer_config.json``) and tests must exercise
that path offline. The model is built and saved by ``transformers`` itself, so the files are exactly what
``save_pretrained`` writes for Qwen2, Qwen3 and Llama, and ``transformers`` can serve as the reference
implementation in tests.

The tokenizer is the one vocabulary of :mod:`support.tiny_models` (byte-level BPE, ChatML special tokens),
written with the ``tokenizers`` library and Qwen2's pre-tokenizer: token ids agree with llama.cpp's on the
tiny GGUFs, so a tiny checkpoint is a valid draft for a tiny GGUF target and vice versa.

Weights are redrawn after construction (``transformers``' default init, std 0.02, gives near-uniform
logits): unit-scale embeddings, sharpened attention and an output spread of about 3 so greedy generations
are varied (tests/support/test_tiny_hf.py checks it, tied and untied). The special tokens' output rows are
zero (logit exactly 0, well below the usual maximum; near 0 when tied, the rows being embeddings too), so
generations rarely stop early, as with the tiny GGUFs.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from support.tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS, tiny_vocab

__all__ = ["QWEN2_SPLIT_REGEX", "Family", "tiny_tokenizer_json", "write_tiny_hf_checkpoint"]

Family = Literal["qwen2", "qwen3", "llama"]

# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen2.5), the one llama.cpp applies for pre "qwen2".
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_STAMP = ".tiny_hf.json"  # the arguments a directory was written with; written last


def tiny_tokenizer_json() -> str:
    """``tokenizer.json`` of the tiny vocabulary: BPE + Qwen2 split + byte-level, special tokens added."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = tiny_vocab()
    n_model = len(vocab.tokens) - len(SPECIAL_TOKENS)
    ranks = {text: i for i, text in enumerate(vocab.tokens[:n_model])}
    merges = [tuple(m.split(" ")) for m in vocab.merges]
    bpe = models.BPE(vocab=ranks, merges=merges, ignore_merges=False)  # type: ignore[arg-type]
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    added = tokenizer.add_special_tokens(specials)
    if added != len(SPECIAL_TOKENS) or tokenizer.token_to_id(SPECIAL_TOKENS[0]) != n_model:
        raise AssertionError("special tokens did not land after the model vocabulary")
    return tokenizer.to_str(pretty=True)


def write_tiny_hf_checkpoint(
    directory: Path,
    family: Family,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    sharded: bool = True,
    rope_scaling: dict[str, Any] | None = None,
) -> Path:
    """Write (unless already written with these arguments) a tiny random checkpoint into ``directory``.

    ``sharded`` saves several ``model-0000x-of-0000n.safetensors`` files and ``model.safetensors.index.json``
    (as large checkpoints ship); otherwise one ``model.safetensors``. ``rope_scaling`` is merged into the
    config's RoPE parameters (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``).
    """
    directory = Path(directory)
    args = {
        "family": family,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "tie_word_embeddings": tie_word_embeddings,
        "sharded": sharded,
        "rope_scaling": rope_scaling,
    }
    stamp = directory / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == args:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a rewrite with other arguments must not leave stale shards behind

    model = _random_model(args)
    # ~90 KB of embeddings: a 100 KB shard limit splits the checkpoint into several files.
    model.save_pretrained(directory, max_shard_size="100KB" if sharded else "1GB")
    vocab = tiny_vocab()
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "normalized": False}
            for i, t in zip(vocab.special_ids, SPECIAL_TOKENS, strict=True)
        },
    }
    _write(directory / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))
    _write(directory / "tokenizer.json", tiny_tokenizer_json())
    _write(stamp, json.dumps(args))
    return directory


def _random_model(args: dict[str, Any]) -> Any:
    """The ``transformers`` model of ``args`` with redrawn, non-degenerate float32 weights."""
    import torch
    import transformers

    vocab = tiny_vocab()
    endoftext, _, im_end = vocab.special_ids
    hidden, ff = int(args["hidden_size"]), int(args["intermediate_size"])
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1_000_000.0} | (args["rope_scaling"] or {})
    max_position = max(4096, int(rope.get("original_max_position_embeddings", 0) * rope.get("factor", 1)))
    config_class, model_class = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[args["family"]]
    config = config_class(
        vocab_size=len(vocab.tokens),
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=int(args["num_layers"]),
        num_attention_heads=int(args["num_heads"]),
        num_key_value_heads=int(args["num_kv_heads"]),
        head_dim=hidden // int(args["num_heads"]),
        max_position_embeddings=max_position,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=bool(args["tie_word_embeddings"]),
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype="float32",
    )
    torch.manual_seed(int(args["seed"]))
    model = model_class(config).to(torch.float32).eval()
    inv = 1.0 / math.sqrt(hidden)
    tied = bool(args["tie_word_embeddings"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight" and tied:
                param.fill_(6.0)  # tied: small embeddings, and the final norm gives logits their spread of ~3
            elif "q_norm" in name or "k_norm" in name:
                param.fill_(2.0)  # Qwen3 normalises each head of q and k: sharpened here instead
            elif "norm" in name:
                param.fill_(1.0)
            elif "embed_tokens" in name:  # [vocab, hidden]
                # Tied, the embedding is the head too: kept small next to the layers' outputs, or each
                # position's own input token dominates its logits and greedy decoding repeats it.
                param.normal_(0.0, 0.5 * inv if tied else 1.0)
            elif "lm_head" in name:
                param.normal_(0.0, 3.0 * inv)  # [vocab, hidden]: logits spread ~3 over unit-RMS states
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5 if ("q_proj" in name or "k_proj" in name) else 0.1)
            elif "q_proj" in name or "k_proj" in name:
                param.normal_(0.0, 2.0 * inv)  # sharpened attention: predictions depend on context
            elif "down_proj" in name:
                param.normal_(0.0, 1.0 / math.sqrt(ff))
            else:
                param.normal_(0.0, inv)
        special = list(vocab.special_ids)
        if tied:  # shrunk, not zeroed: the rows are their tokens' input embeddings too
            model.model.embed_tokens.weight[special] *= 0.1
        else:
            model.lm_head.weight[special] = 0.0  # special tokens: logit exactly 0
    return model


def _write(path: Path, text: str) -> None:
    """Write atomically, so a concurrent reader of a cached directory never sees half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
