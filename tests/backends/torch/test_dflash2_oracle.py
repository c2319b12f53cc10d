"""Our DFlash2 / DFlash network equals the reference package's on the same checkpoint files.

The checkpoint is a random one in the published layout (tests/support/tiny_dflash.py), loaded by the
package's own ``from_pretrained`` and by ``load_block_drafter``. Two drafting rounds, as the reference's
``dflash_generate`` runs them: the first with the whole prompt's context features, the second with three
more committed tokens' (its cache cropped to the context, ours holding only context by construction).
Compared: the block logits (float32, within 1e-4) and the selector's greedy path (exactly).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# Not skipped when missing: scripts/install.sh --dev installs it, and without it this proof would vanish.
import dflash  # noqa: E402,F401
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from specserve.backends.torch.config import DecoderConfig  # noqa: E402
from specserve.backends.torch.dflash2 import DynamicConv  # noqa: E402
from specserve.backends.torch.dflash2_files import load_block_drafter, save_block_drafter  # noqa: E402
from specserve.backends.torch.kv_cache import KVCache  # noqa: E402
from specserve.drafters.dflash2_walk import inverse_cdf, walk  # noqa: E402
from specserve.errors import UserError  # noqa: E402
from support.tiny_dflash import reference_model, write_tiny_dflash  # noqa: E402

VOCAB, HIDDEN, MASK = 300, 64, 0
TOLERANCE = 1e-4


def target_config(layers: int = 2, hidden: int = HIDDEN, vocab: int = VOCAB) -> DecoderConfig:
    return DecoderConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
    )


def target_parts(seed: int = 1) -> tuple[nn.Embedding, nn.Linear]:
    """A target's embedding and LM head (what the drafter borrows), random."""
    torch.manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(head.weight, 0.0, 3.0 / HIDDEN**0.5)
    return embed, head


def context_cache(slots: int) -> KVCache:
    """The drafter's cache for the tiny checkpoint (1 layer, 2 KV heads of 16)."""
    cpu = torch.device("cpu")
    return KVCache(
        num_layers=1,
        num_slots=slots,
        positions=64,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device=cpu,
    )


def reference_rounds(
    directory: Path, contexts: list[Tensor], anchors: list[int], block: int
) -> list[tuple[Tensor, Tensor | None]]:
    """Per round: the reference's block logits [B-1, vocab] and greedy path [B-1] (None for DFlash)."""
    from dflash.model import DFlash2DraftModel, _crop_to, _make_cache

    ref = reference_model(directory)
    embed, head = target_parts()
    cache = _make_cache(ref.config)
    start, results = 0, []
    for context, anchor in zip(contexts, anchors, strict=True):
        start += context.shape[0]
        ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
        positions = torch.arange(start - context.shape[0], start + block)[None]
        with torch.no_grad():
            hidden = ref(
                target_hidden=context[None],
                noise_embedding=F.embedding(ids, embed.weight),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )[:, 1:]
            _crop_to(cache, start)
            logits = ref.compute_logits(hidden, head)
            path = None
            if isinstance(ref, DFlash2DraftModel):
                path = ref.propose(hidden, ids[:, 0], head, 0.0)[0][0]
        results.append((logits[0], path))
    return results


def our_rounds(
    directory: Path, contexts: list[Tensor], anchors: list[int], block: int
) -> list[tuple[Tensor, Tensor]]:
    net = load_block_drafter(directory, target_config(), torch.float32, torch.device("cpu"))
    embed, head = target_parts()
    cache = context_cache(3)
    slot, start, results = 2, 0, []
    with torch.no_grad():
        for context, anchor in zip(contexts, anchors, strict=True):
            net.write_context(cache, slot, start, context)
            start += context.shape[0]
            ids = torch.tensor([[anchor] + [MASK] * (block - 1)])
            hidden = net(F.embedding(ids, embed.weight), cache, [slot], [(0, start)], [start])[:, 1:]
            assert cache.lengths[slot] == start  # the block's keys never enter the cache
            logits = net.logits(hidden, head)
            tokens, _, _ = walk(
                net, hidden, logits, ids[:, 0], torch.zeros(1), torch.zeros(1, block - 1), False
            )
            results.append((logits[0], tokens[0]))
    return results


@pytest.mark.parametrize("version", [2, 1])
def test_forward_and_path_equal_the_reference(tmp_path: Path, version: int) -> None:
    directory = write_tiny_dflash(tmp_path / "d", vocab_size=VOCAB, version=version, block_size=5)
    torch.manual_seed(7)
    contexts = [torch.randn(9, 2 * HIDDEN), torch.randn(3, 2 * HIDDEN)]
    anchors = [17, 230]
    ours = our_rounds(directory, contexts, anchors, 5)
    for (ref_logits, ref_path), (logits, path) in zip(
        reference_rounds(directory, contexts, anchors, 5), ours, strict=True
    ):
        assert (logits - ref_logits).abs().max().item() < TOLERANCE
        if ref_path is not None:
            assert path.tolist() == ref_path.tolist()
        else:
            assert path.tolist() == logits.argmax(-1).tolist()
    # Not a trivial pass: the path varies and leaves the argmax somewhere (the selector's pairwise term).
    if version == 2:
        assert any(p.tolist() != lg.argmax(-1).tolist() for lg, p in ours) or len({*ours[0][1].tolist()}) > 1


def test_batched_sequences_equal_each_alone(tmp_path: Path) -> None:
    """Two sequences of other context lengths in one forward: each as it is alone (padding is masked, and
    the convolution stays inside each block)."""
    directory = write_tiny_dflash(tmp_path / "d", vocab_size=VOCAB, block_size=4)
    net = load_block_drafter(directory, target_config(), torch.float32, torch.device("cpu"))
    embed, _ = target_parts()
    cache = context_cache(2)
    torch.manual_seed(3)
    with torch.no_grad():
        net.write_context(cache, 0, 0, torch.randn(11, 2 * HIDDEN))
        net.write_context(cache, 1, 0, torch.randn(4, 2 * HIDDEN))
        ids = torch.tensor([[5, MASK, MASK, MASK], [9, MASK, MASK, MASK]])
        both = net(F.embedding(ids, embed.weight), cache, [0, 1], [(0, 11), (0, 4)], [11, 4])
        alone = [
            net(F.embedding(ids[i : i + 1], embed.weight), cache, [i], [(0, n)], [n])
            for i, n in ((0, 11), (1, 4))
        ]
    for i in range(2):
        assert (both[i] - alone[i][0]).abs().max().item() < 1e-5


def test_convolution_never_crosses_a_block_boundary() -> None:
    torch.manual_seed(0)
    conv = DynamicConv(32, 2, 8)
    nn.init.normal_(conv.base_kernel)
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        out, _ = conv.prepare(x)
        taps = conv.kernel_projection(x).view(2, 4, 2, 2, 4)[
            :, :, 0
        ]  # the first conv's [S, B, kernel, groups]
        # Position 0 of a block sees only itself: nothing of the previous block (or another sequence).
        first = (conv.base_kernel[0, 0] + taps[:, 0, 0].repeat_interleave(8, dim=-1)) * x[:, 0]
        assert torch.allclose(out[:, 0], first, atol=1e-6)
        changed = x.clone()
        changed[0, 2:] += 5.0  # later positions of block 0 change nothing before them, nor block 1
        out2, _ = conv.prepare(changed)
    assert torch.equal(out2[0, :2], out[0, :2]) and torch.equal(out2[1], out[1])


def test_inverse_cdf_skips_zero_probability() -> None:
    probs = torch.tensor([[0.25, 0.25, 0.5, 0.0]])
    got = [int(inverse_cdf(probs, torch.tensor([u]))[0]) for u in (0.0, 0.3, 0.6, 0.999999999)]
    assert got == [0, 1, 2, 2]


def test_checkpoint_for_another_target_is_refused_in_one_line(tmp_path: Path) -> None:
    directory = write_tiny_dflash(tmp_path / "d", vocab_size=VOCAB)
    for config in (target_config(layers=4), target_config(hidden=128), target_config(vocab=301)):
        with pytest.raises(UserError) as info:
            load_block_drafter(directory, config, torch.float32, torch.device("cpu"))
        assert "\n" not in str(info.value) and "does not fit this target" in str(info.value)


def test_saved_checkpoint_loads_in_the_reference(tmp_path: Path) -> None:
    """What we write (train-drafter's checkpoints) is the published layout: the package loads it."""
    directory = write_tiny_dflash(tmp_path / "d", vocab_size=VOCAB)
    net = load_block_drafter(directory, target_config(), torch.float32, torch.device("cpu"))
    saved = save_block_drafter(net, tmp_path / "saved")
    ref = reference_model(saved)
    ours = dict(net.state_dict())
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
