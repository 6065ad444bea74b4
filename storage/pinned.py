"""Host buffers for the tiers: pinned ones of exactly the size asked for.

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every
request up to the next power of two and caches the blocks.  An LLM expert of
34.4 MB then holds 64 MB of page-locked memory, so a host tier of 1.1 GB held
about 2 GB, none of which the pool's accounting saw (the H200 run of `llm bench
--part c` peaked at 3.79 GB of RSS).  Here the memory is an ordinary
page-aligned allocation of the exact size, which the CUDA driver page-locks in
place (`cudaHostRegister`) and lets go of when the last tensor or view of it
dies.

The price: a registered buffer is not tracked by torch's caching allocator,
which delays the reuse of its own blocks until an asynchronous copy from them
has finished.  Every tier copy here waits for its copy before it returns (see
`TierSource._copy_bytes` and `host_copy`), and the prefill stream waits for a
slot's copy before its host bytes go anywhere (`PrefillBalance._let_go`), so a
buffer is never freed or refilled under a copy in flight.  Where the driver will not register memory,
or torch would not see the result as pinned, the buffer comes from torch's
pinned allocator as before.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

PAGE = 4096


class _Registered:
    """An exact, page-aligned host allocation page-locked by the CUDA driver for as long as this object lives.

    numpy arrays made from it (`np.asarray(self)`) keep it alive through their
    `base`, and torch tensors made from those arrays keep the arrays alive, so
    the memory is unregistered and freed only after the last view is gone.
    """

    def __init__(self, nbytes: int, cudart) -> None:
        self._raw = np.empty(nbytes + PAGE, np.uint8)            # freed after __del__ unregisters it
        start = (-self._raw.ctypes.data) % PAGE
        self.ptr, self.nbytes, self._cudart = self._raw.ctypes.data + start, nbytes, cudart
        self.registered = int(cudart.cudaHostRegister(self.ptr, nbytes, 0)) == 0

    @property
    def __array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}

    def __del__(self) -> None:
        if getattr(self, "registered", False):
            self.registered = False
            rc = int(self._cudart.cudaHostUnregister(self.ptr))
            if rc != 0:        # a buffer we registered: a refusal here is a bug to see, not to hide
                log.warning("cudaHostUnregister of a %d-byte pinned buffer refused (CUDA error %d)", self.nbytes, rc)
                clear_cuda_error()


def clear_cuda_error() -> None:
    """Take a refused CUDA runtime call's error off this thread, where torch's next launch check would raise it.

    The runtime keeps a failed call's error as the thread's last error until
    someone reads it; torch reads it after every kernel launch, so a refused
    `cudaHostRegister` here would surface as an error in an unrelated
    operation later (a GPU test met exactly that).  torch's binding has no
    `cudaGetLastError`, so a one-element launch reads it, and its error is
    dropped.
    """
    try:
        import torch

        torch.empty(1, device="cuda").fill_(0)
    except Exception:  # noqa: BLE001 - the error being cleared is the point (and at shutdown, no torch)
        pass


def host_empty(nbytes: int, pin: bool = False):
    """A CPU uint8 tensor of `nbytes`; page-locked for fast, asynchronous device copies when `pin`.

    Pinned buffers hold exactly `nbytes`, not the next power of
    two.  On a box without CUDA, `pin` fails as `torch.empty(pin_memory=True)` does.
    """
    import torch

    if not pin or nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    try:
        owner = _Registered(nbytes, torch.cuda.cudart())
    except (AttributeError, RuntimeError, TypeError) as exc:   # a torch without cudart's register call
        log.debug("cudaHostRegister unavailable (%s): torch's pinned allocator", exc)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if not owner.registered:        # e.g. a device without host-register support
        clear_cuda_error()
    else:
        t = torch.from_numpy(np.asarray(owner))
        if t.is_pinned():
            return t
        del t
    del owner
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
