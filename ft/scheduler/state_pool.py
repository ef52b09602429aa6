"""The GDN state pool's bookkeeping: one conv + recurrent state slot per running request."""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"state pool exhausted: all {self.num_slots} slots in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
