"""The impure edge of ``offload``: the background thread that runs host work, and the copies that
move bytes between device and host.

Host work is always a pure function of tensors it owns (copies made when the work is handed
over), so running it on the background thread or inline gives the same bits; only the clock
differs. One background thread serves the whole process; a job never waits on another job.
:func:`process` gives the other place host work can run: a worker process
(``offload.host_process``), one per setting of its threads and cores, whose ``submit`` is this
module's, with the same order and the same bits.

On a CUDA device the per-step gradient copy goes through a pinned host buffer with a
``non_blocking`` copy on a stream of its own (:func:`copy_stream`), so it overlaps the loop's next
kernels instead of queueing them behind it; on any other device (and on this project's CPU-only CI) copies are plain
``.to``. "Device" tensors then live on ``cpu`` too, and the code paths are the same.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import Tensor

from offload.host_process import HostProcess

HOST = torch.device("cpu")

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_processes: dict[tuple[int, tuple[int, ...]], HostProcess] = {}
_copy_streams: dict[int, Any] = {}  # CUDA device index -> its copy stream (``copy_stream``)


def submit(fn: Callable[..., Any], /, *args: Any, threads: int | None = None) -> Future:
    """Run ``fn(*args)`` on the process's background thread; returns its ``Future``. Jobs run one
    at a time, in submission order.

    ``threads``: the intra-op threads the job's torch operations use (``None``: the thread's
    count, torch's default). Set on the background thread alone, for the job's duration
    (:func:`_on_threads`): the caller's count and other threads' are untouched
    (``tests/test_offload_worker.py``). On a CPU "device" the training loop's own intra-op
    threads fill the cores: ZenFlow's jobs then ask for one, so that the background thread does
    not run a second OpenMP team (libgomp makes one per calling thread) against the loop's.
    Elementwise results do not depend on the count.
    ``args`` must be owned by the job (nobody else writes them afterwards)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpx-offload")
    if threads is None:
        return _executor.submit(fn, *args)
    return _executor.submit(_on_threads, threads, fn, *args)


def _on_threads(threads: int, fn: Callable[..., Any], /, *args: Any) -> Any:
    """``fn(*args)`` with this thread's OpenMP thread count at ``threads``, put back afterwards.
    Through ``omp_set_num_threads`` (per thread) rather than ``torch.set_num_threads``, which also
    changes the count every thread started meanwhile would take. Where torch has no OpenMP (the
    symbol is missing) ``fn`` runs as it is."""
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return fn(*args)
    before = torch.get_num_threads()  # also makes torch read its per-thread default now, not later
    set_threads(threads)
    try:
        return fn(*args)
    finally:
        set_threads(before)


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """The process's ``omp_set_num_threads`` (torch's OpenMP runtime, loaded with torch), or None."""
    try:
        fn = ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_int]
    return fn


def process(threads: int, cores: tuple[int, ...] = ()) -> HostProcess:
    """The process's host worker process with ``threads`` intra-op threads pinned to ``cores``
    (empty: not pinned), made on the first call with these settings and kept (its child starts on
    its first ``submit``). A worker whose child died stays dead (its ``submit`` raises
    ``HostWorkerDied``) until :func:`forget_process` drops it."""
    key = (threads, tuple(cores))
    with _executor_lock:
        if key not in _processes:
            _processes[key] = HostProcess(threads, key[1])
        return _processes[key]


def forget_process(worker: HostProcess) -> None:
    """Stop ``worker`` and drop it, so that the next :func:`process` call with its settings makes a
    new one."""
    with _executor_lock:
        for key, p in list(_processes.items()):
            if p is worker:
                del _processes[key]
    worker.close()


def resolve(value: Any) -> Any:
    """``value.result()`` for a ``Future`` (re-raising the job's exception), else ``value``."""
    return value.result() if isinstance(value, Future) else value


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def to_host(t: Tensor) -> Tensor:
    """A host copy of ``t``, ready to read. On ``cpu`` returns ``t`` itself: callers pass a tensor
    they own (the result of an indexing op)."""
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()  # the host reads it next
        return buf
    return t.to(HOST)


def to_host_async(t: Tensor) -> tuple[Tensor, Callable[[], None]]:
    """``(buf, ready)``: a host copy of ``t`` under way and a function that blocks until it can be
    read. The training loop enqueues the copy and hands ``ready`` to the background thread, which
    waits for the device there instead of on the loop. On ``cpu`` returns ``t`` itself (callers
    pass a tensor they own) and a no-op. On CUDA ``buf`` is pinned, from torch's caching host
    allocator (reused across steps: a block goes back to it only when the copies recorded on it
    have finished, so no buffer in use is handed out again)."""
    if t.device.type == "cpu":
        return t, _ready
    if t.device.type == "cuda":
        compute = torch.cuda.current_stream(t.device)
        side = copy_stream(t.device)
        side.wait_stream(compute)  # the copy starts once ``t`` is written
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            buf.copy_(t, non_blocking=True)
        t.record_stream(side)  # the allocator keeps ``t``'s memory until the copy has read it
        done = torch.cuda.Event()
        done.record(side)
        return buf, done.synchronize
    return t.to(HOST), _ready


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The process's stream for device-to-host copies on CUDA ``device`` (one per device, made on
    first use). A copy enqueued there does not hold up the kernels the loop enqueues after it on
    its own stream: the next step's forward runs while the gradient crosses the bus."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _executor_lock:
        if index not in _copy_streams:
            _copy_streams[index] = torch.cuda.Stream(device=index)
        return _copy_streams[index]


def _ready() -> None:
    return None


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``. The source is never written afterwards (host results are immutable),
    so an asynchronous copy is safe."""
    return t.to(device, non_blocking=device.type == "cuda")
