"""Pinned host buffers of the exact size (storage/pinned.py).

On this CPU box the CUDA runtime is played by a recorder of register and
unregister calls (a test double for the GPU only); the lifetime logic under
test is the real code.  On a CUDA box the `gpu` tests use the real driver.
"""
from __future__ import annotations

import gc

import numpy as np
import psutil
import pytest
import torch

from storage.pinned import PAGE, _Registered, host_empty


class RecordingCudart:
    """Stands in for `torch.cuda.cudart()` on a box without a GPU: records what is page-locked."""

    def __init__(self, fail: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.fail = fail
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail:
            return 1
        assert ptr not in self.live
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.live.pop(ptr)
        self.unregistered.append(ptr)
        return 0


def test_the_buffer_is_exact_page_aligned_and_stays_registered_while_any_view_lives():
    rt = RecordingCudart()
    n = 34_600_000 + 17                              # an LLM expert's size: not a power of two, nor of pages
    t = torch.from_numpy(np.asarray(_Registered(n, rt)))
    assert t.numel() == n and t.dtype == torch.uint8
    assert t.data_ptr() % PAGE == 0 and rt.live == {t.data_ptr(): n}
    ptr = t.data_ptr()
    t[:] = 7
    view = t[1000:2000].view(torch.int32)            # a FlatWeights-style view outlives the buffer tensor
    del t
    gc.collect()
    assert ptr in rt.live                            # still page-locked: a view uses it
    assert int(view[0]) == 0x07070707
    del view
    gc.collect()
    assert rt.live == {} and rt.unregistered == [ptr]   # unregistered once the last view went


def test_a_register_the_driver_refuses_leaves_nothing_registered():
    rt = RecordingCudart(fail=True)
    owner = _Registered(1 << 20, rt)
    assert not owner.registered
    del owner
    gc.collect()
    assert rt.live == {} and rt.unregistered == []


def test_without_pinning_it_is_a_plain_tensor_and_pinning_without_cuda_fails_as_torch_does():
    t = host_empty(1000)
    assert t.numel() == 1000 and t.dtype == torch.uint8 and t.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            host_empty(1000, pin=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_buffer_is_pinned_exact_and_copies_asynchronously():
    n = 34_600_000 + 17
    proc = psutil.Process()
    torch.zeros(1, device="cuda")
    before = proc.memory_info().rss
    t = host_empty(n, pin=True)
    assert t.is_pinned() and t.numel() == n
    assert proc.memory_info().rss - before < n + (8 << 20)     # not the 64 MiB torch's allocator would take
    t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        d.copy_(t, non_blocking=True)
    stream.synchronize()
    assert torch.equal(d.cpu(), t)
    del t, d


class SpyCudart:
    """The real CUDA runtime, with each register and unregister call's result recorded."""

    def __init__(self) -> None:
        self.real, self.calls = torch.cuda.cudart(), []

    def cudaHostRegister(self, ptr, size, flags):
        rc = int(self.real.cudaHostRegister(ptr, size, flags))
        self.calls.append(("register", ptr, rc))
        return rc

    def cudaHostUnregister(self, ptr):
        rc = int(self.real.cudaHostUnregister(ptr))
        self.calls.append(("unregister", ptr, rc))
        return rc


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_driver_registers_once_and_lets_go_after_the_last_view():
    spy = SpyCudart()
    t = torch.from_numpy(np.asarray(_Registered(10 << 20, spy)))
    assert t.is_pinned()
    view = t[4096:8192]
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert spy.calls == [("register", ptr, 0)] and view.is_pinned()
    del view
    gc.collect()
    assert spy.calls == [("register", ptr, 0), ("unregister", ptr, 0)]   # the driver let it go, without error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refused_register_leaves_no_error_for_the_next_cuda_operation():
    from storage.pinned import clear_cuda_error

    t = host_empty(1 << 20, pin=True)
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(t.data_ptr(), 1 << 20, 0)) != 0     # already registered: refused
    clear_cuda_error()
    assert float((torch.ones(4, device="cuda") * 2).sum()) == 8.0      # would raise the refused call's error
    del t
