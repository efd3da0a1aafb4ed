"""A setting of the process read from the environment once, at the first question, and replaced for a block by
an override (tests, a pinned launch): what the kernel settings (moe/kernels/tiles.py) and the injected faults
(common/injection.py) are. The hot paths that ask (every kernel launch, every MoE call, every phase entry) read
a list, never the environment. Plain lists rather than functools.cache: torch.compile traces the MoE forward,
which asks, and would warn that it ignores an lru_cache wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadOnce(Generic[T]):
    """`read()`'s value, kept from the first `current()` on; `overriding(value)` replaces it inside a block."""

    def __init__(self, read: Callable[[], T]):
        self._read = read
        self._read_value: list[T] = []  # the environment's, once asked
        self._overrides: list[T] = []  # innermost last

    def current(self) -> T:
        """The innermost override, else the environment's value (read at the first call)."""
        if self._overrides:
            return self._overrides[-1]
        if not self._read_value:
            self._read_value.append(self._read())
        return self._read_value[0]

    @contextmanager
    def overriding(self, value: T) -> Iterator[T]:
        """Inside the block, `current()` is `value`; blocks nest, and the value before returns on exit."""
        self._overrides.append(value)
        try:
            yield value
        finally:
            self._overrides.pop()
