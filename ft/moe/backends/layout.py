"""How a bank's per-expert tensors sit in one flat block: expert-major, each expert's bytes contiguous.

    block  uint8 [n, expert_bytes]          one row per expert (or per cache slot)
    row    | w13 | w2 |                     bf16 bank
           | w13 | w13_scale | w13_global | w2 | w2_scale | w2_global |    NVFP4 bank

Each part is exposed as a strided view ``[n, *shape]`` of its dtype, which is what the banks'
loaders and the MoE kernels take (they index experts by stride and need only the last dimension
contiguous). Keeping an expert's bytes together makes moving it one copy: host store row ->
cache slot row is a single host-to-device memcpy of ``expert_bytes`` (1.77 MB for an NVFP4
expert of Qwen3-Next reaches ~51 GB/s; six separate parts of it would not).

This module only lays out memory; it does not decide where blocks live or what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ft.utils import round_up

PART_ALIGN = 16  # bytes: every part starts on a 16-byte boundary (fp32 views, vector loads)
ROW_ALIGN = 256  # bytes: every expert row starts on a 256-byte boundary (DMA friendly)


@dataclass(frozen=True)
class Part:
    name: str
    shape: tuple[int, ...]  # one expert's shape
    dtype: torch.dtype
    offset: int  # bytes from the row start

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ExpertLayout:
    parts: tuple[Part, ...]
    expert_bytes: int  # one row, padded to ROW_ALIGN

    @classmethod
    def of(cls, bank: nn.Module) -> ExpertLayout:
        """The layout of ``bank.expert_tensors`` (shapes read from the bank, which may be on meta)."""
        parts, offset = [], 0
        for name in bank.expert_tensors:
            p = getattr(bank, name)
            part = Part(name, tuple(p.shape[1:]), p.dtype, offset)
            parts.append(part)
            offset = round_up(offset + part.nbytes, PART_ALIGN)
        return cls(tuple(parts), round_up(offset, ROW_ALIGN))

    @property
    def payload_bytes(self) -> int:
        """Bytes an expert really holds (what ``bytes streamed`` counts), without padding."""
        return sum(p.nbytes for p in self.parts)

    def allocate(
        self, n: int, device: torch.device | str, pin: bool = False, zero: bool = True
    ) -> torch.Tensor:
        """A block of ``n`` rows; ``pin`` allocates ordinary memory and page-locks it whole."""
        alloc = torch.zeros if zero else torch.empty
        block = alloc(n, self.expert_bytes, dtype=torch.uint8, device=device)
        if pin:
            pin_in_place(block)
        return block

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> ``[n, *shape]`` view of ``block`` ``[n, expert_bytes]``."""
        assert block.dim() == 2 and block.shape[1] == self.expert_bytes and block.dtype == torch.uint8, (
            f"block {tuple(block.shape)} {block.dtype} is not uint8 [n, {self.expert_bytes}]"
        )
        n = block.shape[0]
        return {
            p.name: block[:, p.offset : p.offset + p.nbytes].view(p.dtype).view(n, *p.shape)
            for p in self.parts
        }


PORTABLE, MAPPED = 1, 2  # cudaHostRegisterPortable, cudaHostRegisterMapped
_REGISTERED: dict[int, object] = {}  # data_ptr -> finaliser, so a block is unregistered once


def pin_in_place(block: torch.Tensor) -> None:
    """Page-lock ``block``'s memory with cudaHostRegister, exactly its size.

    ``Tensor.pin_memory()`` goes through torch's caching host allocator, which rounds every
    allocation up to a power of two: an 11 GB layer block would take 16 GB. Registering ordinary
    memory pins exactly what was allocated. The registration is undone when ``block`` is freed.
    """
    import weakref

    cudart = torch.cuda.cudart()
    ptr, size = block.data_ptr(), block.numel() * block.element_size()
    # portable (any context) and mapped: kernels may read it in place (``host_reads.py``)
    err = cudart.cudaHostRegister(ptr, size, PORTABLE | MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {cudart.cudaGetErrorString(err)}")
    _REGISTERED[ptr] = weakref.finalize(block, _unregister, ptr)


def _unregister(ptr: int) -> None:
    _REGISTERED.pop(ptr, None)
    torch.cuda.cudart().cudaHostUnregister(ptr)
