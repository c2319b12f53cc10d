"""What in a piece of torch code would make the host wait for a CUDA device, seen on a CPU.

A CPU never waits, so the audit reads the calls instead: a :class:`~torch.overrides.TorchFunctionMode`
sees every torch function and tensor method, and records the ones that block the host on a CUDA tensor:

* **reads**: ``tolist``, ``item``, ``cpu``, ``bool()``/``int()``/``float()`` of a tensor, ``nonzero``, and
  indexing with a boolean mask (its result's size lives on the device);
* **blocking copies**: ``.to(device)`` / ``.cuda()`` without ``non_blocking=True`` and
  ``torch.tensor(..., device=...)`` / ``torch.as_tensor(..., device=...)``: an upload from pageable memory
  (on CUDA it waits for the stream first), or a read to the host.

``.numpy()`` is not counted: it fails on a CUDA tensor, so it only runs in CPU-only branches (the CPU's
numpy argmax). Each event names the first specserve frame that made it, so a failure says where.

Example::

    with HostWaits() as audit:
        engine.step()
    assert len(audit.reads()) == 1 and not audit.copies()
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


@dataclass(frozen=True)
class Event:
    kind: str  # "read" or "copy"
    call: str  # the torch function or method
    where: str  # file:line of the specserve code that called it


@dataclass
class HostWaits(TorchFunctionMode):
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        kind = _kind(name, args, kwargs)
        if kind is not None:
            self.events.append(Event(kind, name, _caller()))
        return func(*args, **kwargs)

    def reads(self) -> list[Event]:
        return [e for e in self.events if e.kind == "read"]

    def copies(self) -> list[Event]:
        return [e for e in self.events if e.kind == "copy"]


def _kind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if name in READS:
        return "read"
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return "read"
    if name == "cuda" and not kwargs.get("non_blocking"):
        return "copy"
    if name == "to" and not kwargs.get("non_blocking"):
        positional = [a for a in args[1:] if isinstance(a, (torch.device, str))]
        if "device" in kwargs or positional or any(isinstance(a, torch.Tensor) for a in args[1:]):
            return "copy"
    if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
        return "copy"
    return None


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/specserve/" in frame.filename:
            return f"{frame.filename.rsplit('/specserve/', 1)[1]}:{frame.lineno}"
    return "?"
