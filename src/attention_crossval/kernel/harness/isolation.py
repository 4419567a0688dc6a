"""A kernel in a worker process: a crash, hang or CUDA error ends the worker, not the run.

The worker resolves the kernel (imports the user's module and calls the factory there, so a
factory that crashes or hangs cannot take the caller down), then says ``("ready", spec, checks)``:
the caller learns the declaration without running user code. It then answers
``("run", case, prefill)`` (forward) and ``("backward", case, prefill)`` messages. Its start
(spawn, imports, kernel set-up) has its own limit, ``start_timeout_s``, so the per-call
``timeout_s`` measures the kernel alone: a slow start under load is never misreported as a
hang.

Workers are forked from a fork server that imported the harness once (``_worker_context``),
so replacing a dead worker costs a fork, not a new interpreter importing NumPy and the harness;
each gets the caller's environment as it is at the start. The worker dies with its caller
(``PR_SET_PDEATHSIG`` on Linux, for the fork server as for the worker, plus a thread that
polls the caller's pid everywhere), so killing the caller never leaves a busy worker behind. After
a ``MemoryError`` or a CUDA error the worker is replaced: its heap or context may be unusable.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import reprlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.spec import KernelAdapter, KernelSpec
from attention_crossval.kernel.harness.execution import (
    KernelCrashed,
    Run,
    applied_checks,
    backward_checks,
    execute,
    execute_backward,
)
from attention_crossval.kernel.harness.mapped import Mapped, outbound
from attention_crossval.kernel.harness.phases import CLOCK, phase
from attention_crossval.kernel.harness.registry import IN_PROCESS, factory_path, resolve
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import BackwardCase, Gradients

MAX_TIMEOUT_S = 86_400.0  # one day: longer waits overflow the pipe's poll
DEFAULT_TIMEOUT_S = 300.0  # per call: ``--kernel-timeout`` of the report and of the pytest route
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL_S = 1.0
# What the workers' fork server imports once: first the module that makes it die with its
# caller, then the worker loop's own imports.
_PRELOADED = (
    "attention_crossval.kernel.harness.worker_server",
    "attention_crossval.kernel.harness.forward",
    "attention_crossval.kernel.harness.backward",
    "attention_crossval.kernel.harness.registry",
)
# Error messages after which a worker is replaced: its CUDA context or heap may be corrupt.
_RESTART_WORDS = ("cuda", "illegal", "device-side", "launch")


def _plain(result: AttentionResult | Gradients) -> AttentionResult | Gradients:
    """The result rebuilt from plain arrays, so unpickling it never imports a user's module (a
    kernel may return a subclass)."""
    if isinstance(result, Gradients):
        return Gradients(*(np.asarray(getattr(result, n)) for n in ("dq", "dk", "dv")))
    lse = None if result.lse is None else np.asarray(result.lse)
    return AttentionResult(o=np.asarray(result.o), lse=lse)


def die_with_parent_process() -> None:
    """Linux: ask the kernel for ``SIGKILL`` when this process's parent exits (more exactly:
    the parent's thread that started it), even if this one hangs in native code."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # no libc prctl: the polling thread still ends the worker


def _die_with_caller(caller_pid: int) -> None:
    """End this worker when its caller ends. Its parent is the caller (spawn) or the caller's
    fork server, which itself dies with the caller (:mod:`kernel.harness.worker_server`): the kernel
    ends the worker when that parent ends (:func:`die_with_parent_process`), and a thread
    polling the parent and the caller does everywhere (and covers a caller gone before prctl)."""
    die_with_parent_process()
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid and _alive(caller_pid):
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the pid was reused)
        return True
    return True


def _worker_main(kernel: str, conn: Any, caller_pid: int, environment: dict[str, str]) -> None:
    """Worker loop: resolve the kernel once, send its declaration, then answer run messages.
    ``environment``: the caller's, as it is now (a fork server holds the one it started with).
    The working directory comes first on the import path, as under ``python -m``, so that
    ``--kernel kernel.fa:adapter`` finds the user's module from their repository's root under the
    ``pytest`` and ``attention-report`` scripts too (whose own path entry is their bin folder)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    os.environ.clear()
    os.environ.update(environment)
    _die_with_caller(caller_pid)
    # Ctrl-C in a terminal reaches the whole process group: the caller alone handles it (and
    # ends this worker), so a KeyboardInterrupt seen here can only come from the kernel.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        adapter = resolve(kernel)
        checks = (applied_checks(adapter), backward_checks(adapter))
        spec = KernelSpec(  # a plain KernelSpec: unpickling it never imports the user's module
            **{f.name: getattr(adapter.spec, f.name) for f in dataclasses.fields(KernelSpec)}
        )
    except ValueError as error:  # resolve's and applied_checks' messages name the kernel
        conn.send(("failed", str(error)))
        return
    except BaseException as error:  # noqa: BLE001 - a factory's sys.exit too: reported, not lost
        conn.send(("failed", f"kernel={kernel!r}: set-up raised {type(error).__name__}: {error}"))
        return
    conn.send(("ready", spec, checks))
    while True:
        message = conn.recv()
        if message is None:
            return
        CLOCK.take()  # each reply carries the phases of its own call only
        reply = _answer(adapter, *message)
        release_device_memory()
        conn.send((*reply, CLOCK.take()))


def release_device_memory() -> None:
    """Return torch's cached device memory between calls. A GPU run keeps a worker per kernel
    in every xdist process, all on one GPU, and what each one's allocator kept from its largest
    case added up: ``pytest -m gpu`` with 16 xdist workers on the H200 failed two cases with
    ``CUDA error: out of memory`` (docs/results-h200.md)."""
    torch = sys.modules.get("torch")  # a kernel without torch has no cache to return
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _answer(adapter: KernelAdapter, method: str, payload: Any, prefill: str) -> tuple:
    """A worker's reply to one call: ``("ok", result, writes, input_writes)``, ``("declined",
    reason, "", False)`` or ``("error", text, traceback, restart)``."""
    try:
        case, clean = payload, None
        if isinstance(payload, Mapped):  # the kernel's copy-on-write views, and the clean ones
            case, clean = payload.load(writable=True), payload.load(writable=False)
        run = _method(method)(adapter, case, prefill, clean)
        del case, clean  # drop the mappings (and any private pages) now, not at the next call
        return ("ok", _plain(run.result), run.writes, run.input_writes)
    except Declined as declined:
        return ("declined", str(declined), "", False)
    except KeyboardInterrupt as interrupt:  # raised by the kernel itself (SIGINT is ignored)
        text = f"kernel raised KeyboardInterrupt{f': {interrupt}' if str(interrupt) else ''}"
        return ("error", text, traceback.format_exc(limit=4), False)
    except Exception as error:  # noqa: BLE001 - any kernel error is a finding, reported back
        text = f"{type(error).__name__}: {error}"
        restart = isinstance(error, MemoryError) or any(
            word in text.lower() for word in _RESTART_WORDS
        )
        return ("error", text, traceback.format_exc(limit=4), restart)


def _method(name: str) -> Callable[[Any, Any, str, Any], Run]:
    """What a worker message runs: the forward (``run``) or the backward (``backward``)."""
    return execute_backward if name == "backward" else execute


@dataclass
class IsolatedKernel:
    """A kernel living in a worker process; restarted after a crash, hang, CUDA error or
    MemoryError. It is itself an adapter (``spec``, ``checks``, ``__call__``), learned from the
    worker's handshake.

    ``timeout_s`` limits one call; ``start_timeout_s`` limits the worker's start (until ready).
    """

    kernel: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 600.0
    _process: Any = field(default=None, repr=False)
    _conn: Any = field(default=None, repr=False)
    _declared: tuple[KernelSpec, tuple[frozenset[str], frozenset[str]]] | None = field(
        default=None, repr=False
    )
    _handshake_pending: bool = field(default=False, repr=False)  # launched, "ready" not read
    _busy: bool = field(default=False, repr=False)  # a request sent, its reply not read

    def __post_init__(self) -> None:
        factory_path(self.kernel)  # a malformed name is refused before any process starts
        for name in ("timeout_s", "start_timeout_s"):
            check_timeout(name, getattr(self, name))

    @property
    def spec(self) -> KernelSpec:
        """The kernel's declaration, from the worker's handshake (starting it if needed)."""
        return self._declaration()[0]

    @property
    def checks(self) -> frozenset[str]:
        """The adapter's harness checks (``kernel.harness.execution.applied_checks``), from the
        worker."""
        return self._declaration()[1][0]

    @property
    def backward_checks(self) -> frozenset[str]:
        """Its backward harness checks (``kernel.harness.execution.backward_checks``)."""
        return self._declaration()[1][1]

    def _declaration(self) -> tuple[KernelSpec, tuple[frozenset[str], frozenset[str]]]:
        if self._declared is None or self._handshake_pending:
            self.start()
        assert self._declared is not None
        return self._declared

    def launch(self) -> None:
        """Spawn the worker without waiting for it: its start (spawn, imports, CUDA, kernel
        set-up; seconds for a GPU kernel) then overlaps the caller's own work, such as building
        a case, until the next call that needs the worker waits for its handshake."""
        if self._process is None or not self._process.is_alive():
            self._spawn()

    def start(self) -> None:
        """Start the worker; ValueError naming the kernel if it cannot load, set up or answer."""
        try:
            self._start()
        except KernelCrashed as error:
            raise ValueError(str(error)) from None

    def __call__(self, case: AttentionCase) -> AttentionResult:
        return self.call(case, "zero").result

    def backward(self, case: BackwardCase) -> Gradients:
        return self.call(case, "zero", method="backward").result

    def call(self, case: Any, prefill: str, *, method: str = "run") -> Run:
        """Run ``case`` in the worker (started first if needed) and return its answer:
        ``method`` "run" is the forward, "backward" the backward (a ``BackwardCase``)."""
        if self._process is None or not self._process.is_alive() or self._handshake_pending:
            self._start()
        with phase("transfer"):  # less the worker's own phases, added inside
            *reply, worker_phases = self._request(
                (method, outbound(case), prefill), self.timeout_s, "hang"
            )
            CLOCK.add(worker_phases)
        if reply[0] == "declined":
            raise Declined(reply[1])
        if reply[0] == "error":
            if reply[3]:
                self.close(kill=True)  # MemoryError or CUDA error: the next call gets a fresh one
            raise KernelCrashed("error", f"{reply[1]}\n{reply[2]}")
        _, result, writes, input_writes = reply
        return Run(result, writes, input_writes)

    def _request(self, message: tuple | None, timeout_s: float, what: str) -> tuple:
        """Send ``message`` (None: only wait) and receive the reply within ``timeout_s``."""
        try:
            self._busy = True  # until the reply is read: an interrupted caller leaves it set
            if message is not None:
                self._conn.send(message)
            if not self._conn.poll(timeout_s):
                self.close(kill=True)
                raise KernelCrashed(
                    "timeout", f"no answer within {timeout_s:g} s ({what}); worker killed"
                )
            reply = self._conn.recv()
            self._busy = False
            return reply
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.close(kill=True)
            raise KernelCrashed("crash", f"worker process died ({_exit_reason(code)})") from None

    def _spawn(self) -> None:
        context = _worker_context()
        parent, child = context.Pipe()
        self._process = context.Process(
            target=_worker_main,
            args=(self.kernel, child, os.getpid(), dict(os.environ)),
            daemon=True,
        )
        self._process.start()
        child.close()
        self._conn = parent
        self._handshake_pending = True

    def _start(self) -> None:
        """Spawn the worker unless a launched one is alive, then wait for its handshake (a
        worker that already gave it is left as it is)."""
        alive = self._process is not None and self._process.is_alive()
        if alive and not self._handshake_pending:
            return
        try:
            with phase("worker_start"):
                if not alive:
                    self._spawn()
                self._handshake_pending = False  # what comes next: the handshake or a failure
                reply = self._request(
                    None, self.start_timeout_s, "worker start: spawn, imports, kernel set-up"
                )
        except KernelCrashed as error:
            raise KernelCrashed(error.check, f"kernel={self.kernel!r}: {error}") from None
        if reply[0] == "failed":
            self.close(kill=True)
            raise KernelCrashed("error", reply[1])
        self._declared = (reply[1], reply[2])

    def close(self, *, kill: bool = False) -> None:
        """Stop the worker: politely (it finishes its loop) unless ``kill`` or it is still busy
        with a call (the caller was interrupted, e.g. by Ctrl-C: it would not read the stop)."""
        if self._process is None:
            return
        if not kill and not self._busy and self._process.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=10)
        self._conn.close()
        self._process = self._conn = None
        self._handshake_pending = self._busy = False


def _worker_context() -> multiprocessing.context.BaseContext:
    """Where workers come from: a fork server that imported the harness once (a worker then
    starts in a fork, without importing NumPy, ml_dtypes and the harness again: what makes a
    restart after a crash cheap), else (no fork server on this platform) a fresh interpreter.
    The server imports no kernel and touches no GPU, so each worker sets up CUDA afresh."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOADED))
    return context


def check_timeout(name: str, value: object) -> float:
    """``value`` as a time limit in seconds; ValueError naming ``name`` unless it is a number
    in (0, :data:`MAX_TIMEOUT_S`] (NaN and inf excluded)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{name}={reprlib.repr(value)} must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}"
        )
    return float(value)


def _exit_reason(code: int | None) -> str:
    """``exit code N`` or the signal's name (a segfault shows as SIGSEGV)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def describe(name_or_path: str, *, start_timeout_s: float = 600.0) -> KernelSpec:
    """A kernel's declaration without running its code here: in-process built-ins are resolved,
    every other kernel is set up in a short-lived worker that sends its spec back. ValueError
    naming the kernel when it cannot load, its factory fails, crashes or outlasts
    ``start_timeout_s``, or its ``spec`` is not a KernelSpec.

    >>> describe("streaming-fa").device
    'cpu'
    """
    if name_or_path in IN_PROCESS:
        return resolve(name_or_path).spec
    worker = IsolatedKernel(name_or_path, start_timeout_s=start_timeout_s)
    try:
        return worker.spec
    finally:
        worker.close()
