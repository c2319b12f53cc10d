"""The GPU check's models: random weights of real shapes, built on the device without any file.

Why random weights: the device machine has no network and a call carries at most 64 MiB, so no checkpoint
can reach it; speed depends only on shapes and dtype, and exactness (the self-check, plain vs speculative
output) holds for any weights. The decoder is built on the ``meta`` device, cast, then materialised on the
target device, so an 8B model costs its bf16 bytes once and no host memory.

The scale (``1/sqrt(fan_in)`` for matrices, norms 1, q/k sharpened, a head that spreads the logits by about
3; a tied head gets small embeddings and a final norm of 6 instead) keeps greedy text context-dependent: with
a plain std of 0.02 everywhere attention is nearly uniform and a tied model mostly repeats its input token,
which would make the oracle check trivial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.backends.torch.config import DecoderConfig, RopeScaling
from specserve.backends.torch.model import Decoder
from specserve.backends.torch.runtime import TorchRuntime


def _qwen2(
    vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, head_dim: int
) -> DecoderConfig:
    return DecoderConfig(
        family="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        qk_norm=False,
    )


def _llama(
    vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, head_dim: int
) -> DecoderConfig:
    return DecoderConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        max_position=131072,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
    )


@dataclass(frozen=True)
class Shape:
    """One target and the draft that goes with it (same vocabulary)."""

    name: str
    target: DecoderConfig
    draft: DecoderConfig


SHAPES: tuple[Shape, ...] = (
    Shape(
        "qwen2.5-1.5b",
        _qwen2(151936, 1536, 28, 12, 2, 8960, 128),
        _qwen2(151936, 896, 24, 14, 2, 4864, 64),
    ),
    Shape(
        "llama-3.1-8b",
        _llama(128256, 4096, 32, 32, 8, 14336, 128),
        _qwen2(128256, 896, 24, 14, 2, 4864, 64),
    ),
)
"""Qwen2.5-1.5B with a Qwen2.5-0.5B-shaped draft; Llama-3.1-8B with a 0.5B-shaped draft of its vocabulary."""

TINY_SHAPES: tuple[Shape, ...] = (
    Shape("tiny-qwen2", _qwen2(512, 128, 4, 4, 2, 256, 32), _qwen2(512, 64, 2, 4, 2, 128, 16)),
    Shape("tiny-llama", _llama(512, 128, 2, 8, 2, 256, 16), _qwen2(512, 64, 2, 4, 2, 128, 16)),
)
"""The same families and switches (qkv bias, tied head; llama3 RoPE scaling, untied head), CPU-sized."""


class RandomVocabulary:
    """The vocabulary a runtime over random weights needs: bytes map to fixed ids, ids print as ``<id>``.

    Nothing ends generation, so every run yields exactly ``max_tokens`` tokens.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        # A fixed odd multiplier spreads the 256 byte values over the vocabulary (a bijection mod 2^k).
        return [(b * 4099 + 17) % self.vocab_size for b in text.encode()]

    def token_bytes(self, token_id: int) -> bytes:
        return b"<%d>" % token_id

    def is_eog(self, token_id: int) -> bool:
        return False

    def chat_template(self) -> str | None:
        return None

    def special_token_text(self, which: str) -> str:
        return ""

    def close(self) -> None:
        pass


def random_decoder(
    config: DecoderConfig, device: torch.device, dtype: torch.dtype, context: int, seed: int = 0
) -> Decoder:
    """A decoder of ``config``'s shape with seeded random weights, materialised directly on ``device``."""
    with torch.device("meta"):
        model = Decoder(config)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    hidden, tied = config.hidden_size, config.tie_word_embeddings
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "norm.weight" and tied:
                param.fill_(6.0)  # a tied head's scale: small embeddings, logits spread ~3 all the same
            elif "norm" in name:
                param.fill_(1.0)
            elif name == "embed_tokens.weight":
                # Tied: small, or a token's own embedding dominates its logits and greedy text repeats it.
                param.normal_(0.0, 0.5 / math.sqrt(hidden) if tied else 1.0, generator=generator)
            elif name == "lm_head.weight":
                param.normal_(0.0, 3.0 / math.sqrt(hidden), generator=generator)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1, generator=generator)
            else:
                # fan_in scale; the q and k rows of qkv twice that, so attention picks positions.
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
                if name.endswith("qkv_proj.weight"):
                    qk_rows = (config.num_heads + config.num_kv_heads) * config.head_dim
                    param[:qk_rows] *= 2.0
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_rope_table(context)
    return model.eval()


def weight_bytes_read(model: Decoder) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied embedding table, of
    which a step reads only its own rows."""
    seen: set[int] = set()
    total = 0
    untied = not model.config.tie_word_embeddings
    for name, param in model.named_parameters():
        if id(param) in seen or (untied and name == "embed_tokens.weight"):
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
    return total


def parameter_count(config: DecoderConfig) -> int:
    """Parameters of a decoder of this shape (tied head counted once), without building it."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    layer += 2 * c.hidden_size + ((q + 2 * kv) if c.attention_bias else 0)
    embed = c.vocab_size * c.hidden_size
    return c.num_layers * layer + embed * (1 if c.tie_word_embeddings else 2) + c.hidden_size


def open_runtime(
    name: str,
    model: Decoder,
    *,
    device: torch.device,
    dtype: str,
    exact: bool,
    graphs: bool,
    max_sequences: int,
    context: int,
    self_check: bool = True,
    threads: int | None = None,
    attention: str = "auto",
    compile: bool = False,
) -> TorchRuntime:
    """A runtime over an in-memory ``model`` (runtimes may share one model: each has its own KV cache)."""
    return TorchRuntime(
        f"random:{name}",
        model=model,
        vocabulary=RandomVocabulary(model.config.vocab_size),
        device=str(device),
        dtype=dtype,
        exact=exact,
        self_check=self_check,
        cuda_graphs=graphs,
        max_sequences=max_sequences,
        context_per_sequence=context,
        n_threads=threads,
        attention=attention,
        compile=compile,
    )


PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}
"""Peak HBM bytes/s by device name fragment (first match wins; H200 is the one this check is sized for)."""


def peak_bandwidth(device_name: str) -> float | None:
    for fragment, peak in PEAK_BANDWIDTH.items():
        if fragment in device_name:
            return peak
    return None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device)) if torch.cuda.is_available() else "no CUDA device"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def describe(config: DecoderConfig) -> dict[str, Any]:
    """The shape as the report shows it."""
    return {
        "family": config.family,
        "hidden": config.hidden_size,
        "layers": config.num_layers,
        "heads": f"{config.num_heads}/{config.num_kv_heads}",
        "head_dim": config.head_dim,
        "ffn": config.intermediate_size,
        "vocab": config.vocab_size,
        "tied": config.tie_word_embeddings,
        "params": parameter_count(config),
    }
