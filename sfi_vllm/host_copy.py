"""Small host-to-device copies that never make the host wait for the device.

torch's blocking host-to-device copy (``tensor.to("cuda")``) synchronises the stream
(``cudaStreamSynchronize`` after the copy), and an asynchronous copy from pageable memory may too
(the driver stages it). Either makes the host wait for every kernel already queued, which undoes
CUDA graphs' and vLLM's async scheduling's overlap of host and device work. Per-step tables and
index tensors therefore go through pinned memory (torch's caching host allocator, which keeps a
block alive until the copy that reads it has run) with ``non_blocking=True``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host) on ``device`` without a host wait; a plain copy for non-CUDA devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to_device(values: Sequence, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """:func:`to_device` of ``torch.tensor(values, dtype=dtype)``."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def rows_to_device(rows: Sequence[Sequence[int]], device: torch.device | str,
                   dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """:func:`to_device` of ``rows`` (equal lengths ``n``) as a ``(len(rows), n)`` view whose every
    row starts 16 bytes aligned: the columns are padded, then cut back to ``n``. A kernel that
    takes ``table[i]`` as a pointer then compiles one variant, whatever ``n`` is (Triton
    specialises pointer arguments on 16-byte alignment)."""
    n = len(rows[0]) if rows else 0
    per = 16 // torch.empty((), dtype=dtype).element_size()
    host = torch.zeros(len(rows), max(per, -(-n // per) * per), dtype=dtype)
    if n:
        host[:, :n] = torch.tensor(rows, dtype=dtype)
    return to_device(host, device)[:, :n]


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` from a host tensor without a host wait (``dst`` on any device)."""
    if dst.device.type != "cuda":
        dst.copy_(src)
    else:
        dst.copy_(src.pin_memory(), non_blocking=True)
