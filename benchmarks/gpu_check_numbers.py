"""The GPU check's numbers and attention sections: do the modes compute the same function, and what ran.

``numbers``: every mode (graphs, exact, masked) against eager on the same inputs and the same weights: the
logits of a prompt's last row and of a 9-row verify chunk after it (max absolute difference, relative
error, top-1 agreement), and a greedy continuation token by token (identical, or where it first differs).
A wrong kernel, a graph replaying stale inputs or a padding row leaking into a real one shows here, where
speed alone would not. ``attention``: each runtime's attention kernel and the paths that ran, the cuDNN
version, and which SDPA backends accept the prompt shape (causal, grouped-query) and the old masked shape.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.gpu_check_timing import context_tokens
from specserve.backends.base import DecodeChunk
from specserve.backends.torch.runtime import TorchRuntime

VERIFY_ROWS = 9


def _logits(runtime: TorchRuntime, prompt: list[int], verify: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    runtime.free(0)
    last = runtime.decode([DecodeChunk(0, prompt, 0, 1)]).rows.float().clone()
    rows = runtime.decode([DecodeChunk(0, verify, len(prompt), len(verify))]).rows.float().clone()
    runtime.free(0)
    return last, rows


def _greedy(runtime: TorchRuntime, prompt: list[int], tokens: int) -> list[int]:
    runtime.free(0)
    logits = runtime.decode([DecodeChunk(0, prompt, 0, 1)]).rows
    out: list[int] = []
    for i in range(tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = runtime.decode([DecodeChunk(0, [token], len(prompt) + i, 1)]).rows
    runtime.free(0)
    return out


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    return {
        "max_abs_diff": round(float((a - b).abs().max()), 6),
        "relative_error": round(float((a - b).norm() / b.norm()), 7),
        "top1_agreement": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
    }


def numbers_section(
    runtimes: dict[str, TorchRuntime], prompt_tokens: int, greedy_tokens: int
) -> dict[str, Any]:
    """Each mode against ``eager`` (the same weights): see the module docstring."""
    base = runtimes["eager"]
    vocab = base.config.vocab_size
    prompt = context_tokens(vocab, prompt_tokens, seed=5)
    verify = context_tokens(vocab, VERIFY_ROWS, seed=6)
    reference = _logits(base, prompt, verify)
    reference_greedy = _greedy(base, prompt, greedy_tokens)
    result: dict[str, Any] = {"prompt_tokens": prompt_tokens, "greedy_tokens": greedy_tokens, "modes": {}}
    for mode, runtime in runtimes.items():
        if mode == "eager":
            continue
        last, rows = _logits(runtime, prompt, verify)
        greedy = _greedy(runtime, prompt, greedy_tokens)
        differs = next(
            (i for i, (x, y) in enumerate(zip(greedy, reference_greedy, strict=True)) if x != y), None
        )
        result["modes"][mode] = {
            "prompt_last_row": _compare(last, reference[0]),
            "verify_rows": _compare(rows, reference[1]),
            "greedy_identical": differs is None,
            "greedy_first_difference": differs,
        }
    return result


def _sdpa_backends(runtime: TorchRuntime, rows: int) -> dict[str, str]:
    """Which SDPA backend accepts ``rows`` causal grouped-query rows (the prompt path) and the masked
    shape of the old path: "ok" or the first line of its refusal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    c, device, dtype = runtime.config, runtime.device, runtime.dtype
    q = torch.randn(1, c.num_heads, rows, c.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, c.num_kv_heads, rows, c.head_dim, device=device, dtype=dtype)
    mask = torch.ones(1, 1, rows, rows, device=device, dtype=torch.bool).tril()
    found: dict[str, str] = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for label, kwargs in (("causal", {"is_causal": True}), ("masked", {"attn_mask": mask})):
            try:
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True, **kwargs)
                found[f"{backend.name.lower()} {label}"] = "ok"
            except RuntimeError as exc:
                found[f"{backend.name.lower()} {label}"] = str(exc).strip().splitlines()[0][:160]
    return found


def _cudnn_version() -> int | None:
    cudnn: Any = torch.backends.cudnn  # its functions are untyped
    return int(cudnn.version()) if cudnn.is_available() else None


def kernel_check(runtime: TorchRuntime, rows: int = 8, reps: int = 50) -> dict[str, Any]:
    """The row kernel alone on the device at this model's head layout: error against float64 attention,
    a row's bits alone vs in a batch of ``rows``, and µs per layer call (rows at new positions each rep,
    one sequence per row) against SDPA over gathered keys with a mask, at 1,024 and 4,096 keys."""
    from specserve.backends.torch.row_attention import RowAttention, reference

    c, device, dtype = runtime.config, runtime.device, runtime.dtype
    result: dict[str, Any] = {}
    for keys in (1024, 4096):
        attention = RowAttention(c.num_heads, c.num_kv_heads, c.head_dim, keys)
        k = torch.randn(rows + 1, keys, c.num_kv_heads, c.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(rows, c.num_heads, c.head_dim, device=device, dtype=dtype)
        slots = torch.arange(rows, device=device)
        positions = torch.linspace(keys // 2, keys - 1, rows, device=device).long()
        out = attention(q, k, v, slots, positions)
        expected = reference(q.double(), k.double(), v.double(), slots, positions)
        alone = torch.cat(
            [attention(q[i : i + 1], k, v, slots[i : i + 1], positions[i : i + 1]) for i in range(rows)]
        )
        masked = _masked_sdpa(q, k, v, slots, positions)
        timings = {}
        for label, fn in (("rows_us", attention), ("masked_sdpa_us", _masked_sdpa)):
            fn(q, k, v, slots, positions)
            runtime.synchronize()
            began = time.perf_counter()
            for rep in range(reps):
                fn(q, k, v, slots, (positions - rep).clamp(min=0))
            runtime.synchronize()
            timings[label] = round((time.perf_counter() - began) * 1e6 / reps, 2)
        result[str(keys)] = {
            "relative_error": round(float((out.double() - expected).norm() / expected.norm()), 6),
            "masked_sdpa_relative_error": round(
                float((masked.double() - expected).norm() / expected.norm()), 6
            ),
            "batch_invariant": bool(torch.equal(out, alone)),
            "rows": rows,
            **timings,
        }
    return result


def _masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The attention before the row kernel: each row's keys gathered, a mask, SDPA with grouped heads."""
    length = k.shape[1]
    keys = torch.arange(length, device=q.device)
    mask = keys[None, :] <= positions[:, None]  # [rows, length]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None],
        k[slots].transpose(1, 2),
        v[slots].transpose(1, 2),
        attn_mask=mask[:, None, None],
        enable_gqa=True,
    )
    return out[:, :, 0]


def attention_section(runtimes: dict[str, TorchRuntime], prompt_rows: int) -> dict[str, Any]:
    any_runtime = next(iter(runtimes.values()))
    result: dict[str, Any] = {
        "cudnn": _cudnn_version(),
        "modes": {
            mode: {
                "kernel": rt.attention_kernel,
                "paths_run": sorted(rt.kernels.used),
                "graphs": None if rt.graphs is None else len(rt.graphs.graphs),
                "graph_buckets": None if rt.graphs is None else rt.graphs.buckets,
                "graphs_failed": None if rt.graphs is None else dict(rt.graphs.failed),
            }
            for mode, rt in runtimes.items()
        },
    }
    if any_runtime.device.type == "cuda":
        result["sdpa_backends"] = _sdpa_backends(any_runtime, prompt_rows)
        result["kernel"] = kernel_check(any_runtime)
    return result


def render_numbers(data: dict[str, Any]) -> list[str]:
    lines = ["## numbers\n", "Each mode against eager on the same inputs and weights.\n"]
    for name, entry in data.get("numbers", {}).items():
        lines.append(f"**{name}**\n")
        if "error" in entry:
            lines.append(f"failed: `{entry['error']}`\n")
            continue
        lines += [
            "| mode | prompt row max diff | top-1 | verify max diff | rel. error | top-1 | greedy same |",
            "|---|---|---|---|---|---|---|",
        ]
        for mode, m in entry["modes"].items():
            p, v = m["prompt_last_row"], m["verify_rows"]
            greedy = "yes" if m["greedy_identical"] else f"no (token {m['greedy_first_difference']})"
            lines.append(
                f"| {mode} | {p['max_abs_diff']:.4g} | {p['top1_agreement']} | {v['max_abs_diff']:.4g} | "
                f"{v['relative_error']:.3g} | {v['top1_agreement']} | {greedy} |"
            )
        lines.append("")
    lines += ["## attention\n"]
    for name, entry in data.get("attention", {}).items():
        lines.append(f"**{name}** (cuDNN {entry.get('cudnn')})\n")
        if "error" in entry:
            lines.append(f"failed: `{entry['error']}`\n")
            continue
        for mode, m in entry["modes"].items():
            failed = f", failed {m['graphs_failed']}" if m.get("graphs_failed") else ""
            graphs = f"; {m['graphs']} graphs, buckets {m['graph_buckets']}{failed}" if m["graphs"] else ""
            lines.append(f"- {mode}: {m['kernel']}; ran {', '.join(m['paths_run'])}{graphs}")
        for label, verdict in entry.get("sdpa_backends", {}).items():
            lines.append(f"- SDPA {label}: {verdict}")
        for keys, m in entry.get("kernel", {}).items():
            lines.append(
                f"- row kernel, {m['rows']} rows at up to {keys} keys: {m['rows_us']} µs per layer call "
                f"(masked SDPA {m['masked_sdpa_us']} µs), relative error {m['relative_error']} (masked SDPA "
                f"{m['masked_sdpa_relative_error']}), batch-invariant {m['batch_invariant']}"
            )
        lines.append("")
    return lines
