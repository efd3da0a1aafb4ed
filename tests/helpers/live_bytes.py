"""The bytes of the tensors a piece of code creates that are alive at once, at their peak: a dispatch mode that
notes each new storage an op returns and forgets it when it is freed (torch's storage weak references), so it
sees what autograd saves, the backward's temporaries and their release, on the CPU, without an allocator's
caching or rounding. Storages that existed before (parameters, inputs) are not counted.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, tuple[int, int]] = {}  # data_ptr -> (weak reference, bytes)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._forget_freed()  # first: a new output may sit where a storage freed inside the op was
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t.untyped_storage())
        self.peak = max(self.peak, self.now)
        return out

    def alive(self) -> int:
        """The bytes alive now (what was freed since the last op forgotten first)."""
        self._forget_freed()
        return self.now

    def _note(self, storage) -> None:
        key = storage.data_ptr()
        if key and key not in self.live and key not in self.existing:
            self.live[key] = (storage._weak_ref(), storage.nbytes())
            self.now += storage.nbytes()

    def _forget_freed(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if torch.UntypedStorage._expired(ref)]:
            ref, nbytes = self.live.pop(key)
            torch.UntypedStorage._free_weak_ref(ref)
            self.now -= nbytes
