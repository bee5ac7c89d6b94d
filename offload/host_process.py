"""The host worker in its own process: ZenFlow's host optimizer off the training loop's interpreter.

A :class:`HostProcess` runs jobs ``fn(*args)`` in a child process (:func:`main`)
with its own interpreter, its own intra-op thread count and, optionally, its own cores: host work
there never takes the loop's GIL, and its threads can be kept off the loop's cores (DeepSpeed runs
ZenFlow's host optimizer the same way, in a process on cores the training process leaves free).
``submit`` returns a ``concurrent.futures.Future``, as :func:`offload.worker.submit` does; jobs run
in submission order, one at a time.

Tensors cross by one of two roads, chosen per tensor's storage:

* **shared memory, by reference**: a CPU tensor whose storage is in shared memory
  (``Tensor.share_memory_()``) is sent as ``(storage id, offset, shape, stride, dtype)``. The first
  time a storage is sent its file descriptor goes with the message, once; the child maps it and
  keeps it under that id until the parent's storage is freed. The child's in-place writes to it are
  the parent's writes: the caller shares exactly the tensors the job writes (and the large ones it
  reads), allocated once and reused, so a steady run moves only small messages.
* **by value**: any other tensor is pickled with its bytes (the small index and count tensors of a
  job, the fresh tensors a job returns).

A result tensor whose storage is one the parent sent comes back as that tensor of the parent's.

Lifetime: the child dies with its parent (``PR_SET_PDEATHSIG`` on Linux, set by the child, which
also exits when it sees its parent's pid change or its socket close). A child that dies is named:
the job waiting for it, and every later ``submit``, raise :class:`HostWorkerDied` with its pid and
exit status, within :data:`POLL_S` seconds of its death (``tests/test_zenflow_process.py::
test_a_killed_worker_is_named_at_the_next_wait``, ``test_the_worker_dies_with_its_parent``).
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

POLL_S = 0.5
"""Seconds between the parent's checks that a child it waits for is still alive."""
_HEADER = struct.Struct("<QQI")  # header bytes, job bytes, file descriptors attached
_REPLY = struct.Struct("<Q")
_PR_SET_PDEATHSIG = 1


class HostWorkerDied(RuntimeError):
    """The host worker process is gone: its pid and how it ended are in the message."""


class HostJobFailed(RuntimeError):
    """A job raised in the host worker process and its exception could not be sent back as it was:
    the message holds the child's traceback."""


# --- the parent's side --------------------------------------------------------------------------


class HostProcess:
    """A child process that runs host jobs. ``threads``: its intra-op threads
    (``torch.set_num_threads``); ``cores``: the CPUs it is pinned to (``os.sched_setaffinity``),
    empty to leave its affinity as inherited. The child starts on the first ``submit`` (about the
    time it takes to import torch) and is stopped by :meth:`close` or at the parent's exit."""

    def __init__(self, threads: int = 1, cores: tuple[int, ...] = ()):
        if not (isinstance(threads, int) and threads >= 1):
            raise ValueError(f"host worker threads must be an int >= 1, got {threads!r}")
        self.threads, self.cores = threads, tuple(cores)
        self._relay = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdpx-host-relay")
        self._lock = threading.Lock()
        self._child: dict[str, Any] = {"sock": None, "proc": None}  # what the finalizer stops
        self._dead: str | None = None
        self._ids: dict[int, tuple[StorageWeakRef, int]] = {}  # storage data_ptr -> (weak ref, id)
        self._next_id = 0
        self._forget: list[int] = []
        self._finalizer = weakref.finalize(self, _stop, self._relay, self._child)

    @property
    def pid(self) -> int | None:
        """The child's pid once started, else ``None``."""
        proc = self._child["proc"]
        return None if proc is None else proc.pid

    @property
    def storages_sent(self) -> int:
        """How many shared storages have gone to the child so far (each once): flat in a run
        that reuses its buffers (``tests/test_zenflow_process.py``)."""
        return self._next_id

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        """Run ``fn(*args)`` in the child; returns its ``Future`` (the job's result, or its
        exception re-raised; :class:`HostWorkerDied` if the child is gone). ``fn`` and ``args``
        must pickle (module-level functions, ``functools.partial`` of them, optimizers with a
        ``recipe``). Pickled here, on the caller's thread, so the caller may hand over tensors it
        writes again after this returns only if they went by value (see the module docstring)."""
        if self._dead is not None:
            raise HostWorkerDied(self._dead)
        with self._lock:
            held: dict[int, Any] = {}
            new: list[tuple[int, int, int]] = []  # (id, fd, nbytes)
            job = self._pickle((fn, args), held, new)
            forget, self._forget = self._forget, []
            header = pickle.dumps(([(i, n) for i, _, n in new], forget))
            fds = [fd for _, fd, _ in new]
        return self._relay.submit(self._call, header, job, fds, held)

    def close(self) -> None:
        """Stop the child (it finishes the job it runs) and the relay thread."""
        self._finalizer()

    # On the caller's thread: tensors in shared memory become references.
    def _pickle(self, obj: Any, held: dict[int, Any], new: list[tuple[int, int, int]]) -> bytes:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda o: self._reference(o, held, new)  # type: ignore[method-assign]
        pickler.dump(obj)
        return buf.getvalue()

    def _reference(self, obj: Any, held: dict[int, Any], new: list[tuple[int, int, int]]) -> tuple | None:
        if not isinstance(obj, Tensor) or obj.device.type != "cpu" or not obj.is_shared():
            return None
        storage = obj.untyped_storage()
        if storage.nbytes() == 0:
            return None
        ptr = storage.data_ptr()
        known = self._ids.get(ptr)
        if known is not None and not known[0].expired():
            sid = known[1]
        else:
            if known is not None:
                self._forget.append(known[1])
            sid, self._next_id = self._next_id, self._next_id + 1
            fd, nbytes = storage._share_fd_cpu_()
            new.append((sid, fd, nbytes))
            self._ids[ptr] = (StorageWeakRef(storage), sid)
            self._sweep()
        held[sid] = storage  # alive until the reply is read: results may refer to it
        return ("t", sid, obj.storage_offset(), tuple(obj.shape), obj.stride(), obj.dtype)

    def _sweep(self) -> None:
        """Tell the child to drop the storages the parent has freed."""
        for ptr, (ref, sid) in list(self._ids.items()):
            if ref.expired():
                del self._ids[ptr]
                self._forget.append(sid)

    # On the relay thread: one job at a time, in order.
    def _call(self, header: bytes, job: bytes, fds: list[int], held: dict[int, Any]) -> Any:
        if self._dead is not None:
            raise HostWorkerDied(self._dead)
        if self._child["proc"] is None:
            self._start()
        sock = self._child["sock"]
        try:
            sock.sendall(_HEADER.pack(len(header), len(job), len(fds)))
            if fds:
                socket.send_fds(sock, [b"F"], fds)
            sock.sendall(header)
            sock.sendall(job)
            (size,) = _REPLY.unpack(self._recv(_REPLY.size))
            reply = self._recv(size)
        except (OSError, EOFError) as e:
            raise self._died(e) from e
        unpickler = pickle.Unpickler(io.BytesIO(reply))
        unpickler.persistent_load = lambda pid: _rebuild(held[pid[1]], pid)  # type: ignore[method-assign]
        status, value = unpickler.load()
        if status == "ok":
            return value
        raise value

    def _recv(self, n: int) -> bytes:
        sock, proc = self._child["sock"], self._child["proc"]
        out = bytearray()
        while len(out) < n:
            ready, _, _ = select.select([sock], [], [], POLL_S)
            if not ready:
                if proc.poll() is not None:
                    raise EOFError("the host worker process exited")
                continue
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the host worker process closed its socket")
            out += chunk
        return bytes(out)

    def _died(self, cause: BaseException) -> HostWorkerDied:
        proc = self._child["proc"]
        try:
            code = proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with status {code}" if code is not None else f"stopped answering ({cause})")
        self._dead = f"the host worker process (pid {proc.pid}) {how}; its host jobs are lost"
        return HostWorkerDied(self._dead)

    def _start(self) -> None:
        """Start the child from the relay thread: ``PR_SET_PDEATHSIG`` fires when the thread that
        started a process ends, and the relay thread lives as long as this object."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(self.threads)}
        cmd = [sys.executable, "-c", "import sys; from offload.host_process import main; main(sys.argv[1:])",
               str(theirs.fileno()), str(os.getpid()), str(self.threads), ",".join(map(str, self.cores))]
        self._child["proc"] = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._child["sock"] = ours


def _stop(relay: ThreadPoolExecutor, child: dict[str, Any]) -> None:
    """Close the child's socket (it exits at end of file, after the job it runs), wait briefly,
    then kill it."""
    sock, proc = child["sock"], child["proc"]
    if sock is not None:
        sock.close()
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    relay.shutdown(wait=False)


def _rebuild(storage: Any, pid: tuple) -> Tensor:
    _, _, offset, shape, stride, dtype = pid
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def resource_usage() -> dict[str, float]:
    """A job: the calling process's CPU seconds (user, system, every thread), minor page faults
    and peak resident set in bytes. Submitted to a :class:`HostProcess`, the child's own."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    peak = ru.ru_maxrss * 1024
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"user_s": ru.ru_utime, "sys_s": ru.ru_stime, "faults": ru.ru_minflt, "peak_rss": peak}


# --- the child's side ---------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when its parent ends; exit now if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the socket's end of file and the pid watch below still stop it
    if os.getppid() != parent:
        os._exit(0)


def _recv_exact(sock: socket.socket, n: int, parent: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        ready, _, _ = select.select([sock], [], [], POLL_S)
        if not ready:
            if os.getppid() != parent:
                return None
            continue
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _serve(sock: socket.socket, parent: int) -> None:
    """Run jobs until the parent closes the socket or goes away."""
    storages: dict[int, Any] = {}  # id -> the mapped storage
    ids: dict[int, int] = {}  # data_ptr -> id
    while True:
        head = _recv_exact(sock, _HEADER.size, parent)
        if head is None:
            return
        n_header, n_job, n_fds = _HEADER.unpack(head)
        fds: list[int] = []
        if n_fds:
            _, fds, _, _ = socket.recv_fds(sock, 1, n_fds)
        header, job = _recv_exact(sock, n_header, parent), _recv_exact(sock, n_job, parent)
        if header is None or job is None:
            return
        new, forget = pickle.loads(header)
        for sid in forget:
            s = storages.pop(sid, None)
            if s is not None:
                ids.pop(s.data_ptr(), None)
        for (sid, nbytes), fd in zip(new, fds):
            s = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
            os.close(fd)
            storages[sid], ids[s.data_ptr()] = s, sid
        try:
            unpickler = pickle.Unpickler(io.BytesIO(job))
            unpickler.persistent_load = lambda pid: _rebuild(storages[pid[1]], pid)  # type: ignore[method-assign]
            fn, args = unpickler.load()
            reply = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the waiting job
            reply = ("err", e)
        sock.sendall(_reply_bytes(reply, ids))


def _reply_bytes(reply: tuple[str, Any], ids: dict[int, int]) -> bytes:
    def reference(o: Any) -> tuple | None:
        if not isinstance(o, Tensor) or o.device.type != "cpu":
            return None
        sid = ids.get(o.untyped_storage().data_ptr())
        return None if sid is None else ("t", sid, o.storage_offset(), tuple(o.shape), o.stride(), o.dtype)

    def dump(obj: Any) -> bytes:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = reference  # type: ignore[method-assign]
        pickler.dump(obj)
        return buf.getvalue()

    try:
        body = dump(reply)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as its text
        import traceback
        err = reply[1] if reply[0] == "err" else None
        text = "".join(traceback.format_exception(err)) if err is not None else traceback.format_exc()
        body = dump(("err", HostJobFailed(f"a host job failed in the host worker process:\n{text}")))
    return _REPLY.pack(len(body)) + body


def main(argv: list[str]) -> None:
    """The child's entry, ``argv = [socket fd, parent pid, threads, cores "0,1" or ""]``."""
    fd, parent, threads, cores = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    _die_with_parent(parent)
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    torch.set_num_threads(threads)
    sock = socket.socket(fileno=fd)
    try:
        _serve(sock, parent)
    finally:
        sock.close()

