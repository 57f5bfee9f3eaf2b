"""KV-cache memory for a stage's sessions, drawn from a pool of fixed size.

Each session gets one pre-allocated cache for its whole length (prompt + new tokens) at open,
so decode steps never re-allocate. The pool only counts bytes: a session that would push it
past its capacity is refused at once (RESOURCE_EXHAUSTED upstream) instead of crashing the
process with an out-of-memory error later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class PoolExhausted(RuntimeError):
    """The pool has no room for the session; retry elsewhere or later."""


@dataclass
class SessionCache:
    # k, v: [num_layers_in_stage, num_kv_heads, capacity, head_dim]
    k: torch.Tensor
    v: torch.Tensor
    capacity: int
    # Positions already filled; the next step must start here.
    length: int = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class KVPool:
    capacity_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    used_bytes: int = field(default=0, init=False)

    def bytes_for(self, max_length: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * max_length * self.head_dim * itemsize

    def allocate(self, max_length: int) -> SessionCache:
        need = self.bytes_for(max_length)
        if self.used_bytes + need > self.capacity_bytes:
            raise PoolExhausted(
                f"KV pool full: a session of {max_length} positions needs {need} bytes, "
                f"{self.capacity_bytes - self.used_bytes} of {self.capacity_bytes} free; "
                "retry on another chain or later, or start the stage with a larger --kv-cache-gb"
            )
        shape = (self.num_layers, self.num_kv_heads, max_length, self.head_dim)
        try:
            cache = SessionCache(
                k=torch.empty(shape, dtype=self.dtype, device=self.device),
                v=torch.empty(shape, dtype=self.dtype, device=self.device),
                capacity=max_length,
            )
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            # The device had less room than the pool's budget (another process took it): refuse
            # this session like a full pool, never crash the stage.
            raise PoolExhausted(f"the device could not allocate {need} bytes of KV cache for {max_length} "
                                f"positions ({type(exc).__name__}); retry on another chain or later") from exc
        self.used_bytes += need
        return cache

    def release(self, cache: SessionCache) -> None:
        self.used_bytes -= cache.nbytes
