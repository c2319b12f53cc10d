"""Tiny random GGUF models that the real llama.cpp backend loads and runs in milliseconds.

Why: the test suite must exercise the real llama.cpp runtime (tokenizer, KV cache, batching, logits) without
downloading a multi-gigabyte model. These files are written on the fly with the ``gguf`` package: a ``qwen2``
architecture (the default real models are Qwen2.5) with seeded random weights and one shared byte-level BPE
vocabulary, so every model written here is a valid draft for every other one.

Three models make up a set (see `tiny_model_set`):

* ``target``: the model being sped up;
* ``draft``: a different, smaller random model (acceptance is near chance);
* ``draft_close``: the target's weights plus a little noise, so greedy acceptance is high but not 100 %
  (about 80 % of the target's greedy tokens are also the draft's greedy choice).

The special tokens' logits are fixed at ``eos_logit_bias`` (a zero row in ``output.weight`` plus the optional
``output.bias`` tensor, which llama.cpp's qwen2 loader accepts), so generations normally run to
``max_tokens``; write a model with a large positive bias when a test wants end-of-generation.

Run these models with one thread: they gain nothing from more, and on a busy machine the OpenMP barriers
between graph nodes can stall a multi-threaded decode for seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
import numpy.typing as npt

from specserve.backends.torch.hf_vocab import byte_decoder

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TinyModels",
    "TinyVocab",
    "WeightType",
    "tiny_model_pair",
    "tiny_model_set",
    "tiny_vocab",
    "write_tiny_model",
]

WeightType = Literal["f32", "f16", "q8_0"]
FloatArray = npt.NDArray[np.float32]

# ChatML, as in Qwen2.5's template but without its default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Merges of common English and Python pairs, in plain text (mapped to byte-level symbols when written).
# Each side must be a byte or the result of an earlier merge.
# fmt: off
_MERGES_TEXT: tuple[tuple[str, str], ...] = (
    (" ", "t"), (" ", "a"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"), (" t", "he"), ("e", "r"),
    (" ", "s"), ("a", "t"), (" ", "w"), (" ", "o"), ("e", "n"), (" ", "c"), ("i", "t"), ("i", "s"),
    ("a", "n"), ("o", "r"), ("e", "s"), (" ", "b"), ("e", "d"), (" ", "f"), ("in", "g"), (" ", "p"),
    ("o", "u"), (" a", "n"), ("a", "l"), ("a", "r"), (" t", "o"), (" ", "m"), (" o", "f"), (" ", "in"),
    (" ", "d"), (" ", "h"), (" an", "d"), ("i", "c"), ("a", "s"), ("l", "e"), (" t", "h"), ("i", "on"),
    ("o", "m"), ("l", "l"), ("en", "t"), (" ", "n"), (" ", "l"), ("s", "t"), (" ", "re"), ("v", "e"),
    (" ", "e"), ("r", "o"), ("l", "y"), (" b", "e"), (" ", "g"), (" ", "T"), ("c", "t"), (" ", "S"),
    (" ", "I"), ("u", "t"), (" ", "is"), (" ", "on"), (" th", "at"), ("t", "h"), (" ", "w"), (" w", "i"),
    (" wi", "th"), (" ", " "), ("  ", "  "), (" ", "="), (" ", "+"), (" ", "x"), ("d", "e"), ("de", "f"),
    (" ", "def"), ("re", "t"), ("u", "r"), ("ret", "ur"), ("retur", "n"), (" re", "t"), (" ret", "ur"),
    (" retur", "n"), ("(", ")"), ("e", "l"), ("el", "f"), ("s", "elf"), (" ", "i"), (" i", "f"), ("p", "r"),
    ("in", "t"), ("pr", "int"), ("\n", "\n"), (":", "\n"), ("o", "f"), ("or", "t"), (" i", "m"), (" im", "p"),
    (" imp", "ort"),
)
# fmt: on


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode mapping (space is 'Ġ', newline is 'Ċ')."""
    return {byte: char for char, byte in byte_decoder().items()}


@dataclass(frozen=True)
class TinyVocab:
    """The shared vocabulary: 256 byte tokens, merged tokens, then the special (CONTROL) tokens."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]

    def token_id(self, text: str) -> int:
        return self.tokens.index(text)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return tuple(self.token_id(t) for t in SPECIAL_TOKENS)


@cache
def tiny_vocab() -> TinyVocab:
    """Build the vocabulary (deterministic; every tiny model uses exactly this one)."""
    byte_map = _bytes_to_unicode()

    def sym(text: str) -> str:
        return "".join(byte_map[b] for b in text.encode("utf-8"))

    tokens = [byte_map[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    for left, right in _MERGES_TEXT:
        a, b = sym(left), sym(right)
        if a not in known or b not in known:
            raise ValueError(f"merge {left!r} + {right!r} uses a token that is not yet in the vocabulary")
        if a + b in known:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    return TinyVocab(tokens=(*tokens, *SPECIAL_TOKENS), token_types=tuple(types), merges=tuple(merges))


def _random_weights(
    rng: np.random.Generator,
    *,
    n_vocab: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    logit_scale: float,
) -> dict[str, FloatArray]:
    """Seeded weights, numpy shape (out, in): gguf-py writes shapes reversed, i.e. llama.cpp's {in, out}.

    Scales keep every activation near unit RMS; attention logits are sharpened (q scale 2) so a token's
    prediction depends on its context, and the output matrix gives logits a spread of ``logit_scale``.
    """

    def normal(shape: tuple[int, ...], std: float) -> FloatArray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    n_embd_kv = n_embd // n_head * n_head_kv
    inv = 1.0 / np.sqrt(n_embd)
    weights: dict[str, FloatArray] = {"token_embd.weight": normal((n_vocab, n_embd), 1.0)}
    for i in range(n_layer):
        p = f"blk.{i}."
        weights |= {
            p + "attn_norm.weight": np.ones(n_embd, np.float32),
            p + "attn_q.weight": normal((n_embd, n_embd), 2.0 * inv),
            p + "attn_q.bias": normal((n_embd,), 0.5),
            p + "attn_k.weight": normal((n_embd_kv, n_embd), 2.0 * inv),
            p + "attn_k.bias": normal((n_embd_kv,), 0.5),
            p + "attn_v.weight": normal((n_embd_kv, n_embd), inv),
            p + "attn_v.bias": normal((n_embd_kv,), 0.1),
            p + "attn_output.weight": normal((n_embd, n_embd), inv),
            p + "ffn_norm.weight": np.ones(n_embd, np.float32),
            p + "ffn_gate.weight": normal((n_ff, n_embd), inv),
            p + "ffn_up.weight": normal((n_ff, n_embd), inv),
            p + "ffn_down.weight": normal((n_embd, n_ff), 1.0 / np.sqrt(n_ff)),
        }
    weights["output_norm.weight"] = np.ones(n_embd, np.float32)
    weights["output.weight"] = normal((n_vocab, n_embd), logit_scale * inv)
    return weights


def write_tiny_model(
    path: Path,
    *,
    seed: int,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    weight_type: WeightType = "f32",
    eos_logit_bias: float = -4.0,
    logit_scale: float = 3.0,
    noise: float = 0.0,
    noise_seed: int = 0,
) -> Path:
    """Write a llama.cpp-loadable qwen2 GGUF with random weights drawn from ``default_rng(seed)``.

    ``noise`` > 0 adds ``noise * std(tensor)`` Gaussian noise (from ``default_rng(noise_seed)``) to every
    weight drawn from ``seed``: a perturbed copy of the model with that seed and shapes, i.e. a draft that
    mostly agrees with it. The logit of every special token (EOS/EOT included) is exactly ``eos_logit_bias``:
    the default -4 sits far below the usual maximum (about +8), so generation runs to max_tokens; +20 makes
    greedy decoding stop at once.
    ``q8_0`` needs every matrix row length (n_embd, n_ff) to be a multiple of 32.
    """
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    vocab = tiny_vocab()
    n_vocab = len(vocab.tokens)
    dims = {"n_embd": n_embd, "n_layer": n_layer, "n_head": n_head, "n_head_kv": n_head_kv, "n_ff": n_ff}
    weights = _random_weights(np.random.default_rng(seed), n_vocab=n_vocab, logit_scale=logit_scale, **dims)
    if noise > 0.0:
        noise_rng = np.random.default_rng(noise_seed)
        for name, w in weights.items():
            weights[name] = (w + noise_rng.standard_normal(w.shape) * noise * w.std()).astype(np.float32)
    # Special tokens get a zero output row and a bias: their logit is exactly eos_logit_bias everywhere.
    special = list(vocab.special_ids)
    weights["output.weight"][special] = 0.0
    weights["output.bias"] = np.zeros(n_vocab, np.float32)
    weights["output.bias"][special] = eos_logit_bias

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(tmp, "qwen2")
    writer.add_name(f"specserve-tiny-{n_embd}x{n_layer}-seed{seed}")
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_file_type(int(file_types[weight_type]))
    _add_tokenizer(writer, vocab)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16}.get(
        weight_type, gguf.GGMLQuantizationType.Q8_0
    )
    for name, w in weights.items():
        if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)  # norms and biases stay f32, as in llama.cpp's converters
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quantize(w, qtype), raw_shape=None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)  # atomic: a reader never sees a half-written model
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: TinyVocab) -> None:
    """Tokenizer metadata as in Qwen2.5's GGUFs: gpt2 BPE, qwen2 pre-tokenizer, no BOS, ChatML."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.token_types))
    writer.add_token_merges(list(vocab.merges))
    endoftext, _, im_end = vocab.special_ids
    writer.add_bos_token_id(endoftext)
    writer.add_eos_token_id(im_end)
    writer.add_eot_token_id(im_end)
    writer.add_pad_token_id(endoftext)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


@dataclass(frozen=True)
class TinyModels:
    """Paths of one tiny model set; all share `tiny_vocab`."""

    target: Path  # n_embd 64, 2 layers, seed 1
    draft: Path  # a different random model: n_embd 32, 1 layer, seed 2
    draft_close: Path  # the target plus 2 % noise: ~80 % teacher-forced greedy agreement with it


def tiny_model_pair(directory: Path) -> tuple[Path, Path]:
    """Write (if absent) and return ``(tiny-target.gguf, tiny-draft.gguf)`` in ``directory``."""
    models = tiny_model_set(directory, close=False)
    return models.target, models.draft


def tiny_model_set(directory: Path, *, close: bool = True) -> TinyModels:
    """Write (if absent) the target, the unrelated draft and (if ``close``) the perturbed-target draft."""
    directory = Path(directory)
    target = directory / "tiny-target.gguf"
    draft = directory / "tiny-draft.gguf"
    draft_close = directory / "tiny-draft-close.gguf"
    if not target.exists():
        write_tiny_model(target, seed=1)
    if not draft.exists():
        write_tiny_model(draft, seed=2, n_embd=32, n_layer=1, n_ff=64)
    if close and not draft_close.exists():
        write_tiny_model(draft_close, seed=1, noise=0.02, noise_seed=3)
    return TinyModels(target=target, draft=draft, draft_close=draft_close)
