"""A kernel in a spawned worker process: a crash, hang or CUDA error ends the worker, not the run.

The worker resolves the kernel, says it is ready, then answers ``("run", case, prefill)``
(forward) and ``("backward", case, prefill)`` messages. Its start (spawn, imports, kernel
set-up) has its own limit, ``start_timeout_s``, so the per-call ``timeout_s`` measures the
kernel alone: a slow start under load is never misreported as a hang.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attention_crossval.kernel.spec import KernelAdapter
from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import Gradients


class Declined(Exception):
    """Raised by an adapter whose kernel refuses a case its spec cannot rule out (e.g. an SDPA
    backend with "No available kernel"); the verdict is then skipped with this reason."""


class KernelCrashed(Exception):
    """The isolated kernel failed: ``check`` is "error", "crash" or "timeout"."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


def execute(
    adapter: KernelAdapter, case: AttentionCase, prefill: str
) -> tuple[AttentionResult, tuple[str, ...]]:
    """One call: through ``run_guarded`` when the adapter has it, else ``adapter(case)``."""
    if hasattr(adapter, "run_guarded"):
        result, writes = adapter.run_guarded(case, prefill=prefill)
        return result, tuple(writes)
    return adapter(case), ()


def _worker_main(kernel: str, conn: Any) -> None:
    """Worker loop: resolve the kernel once, say "ready", then answer run messages."""
    from attention_crossval.kernel.registry import resolve

    adapter = resolve(kernel)
    conn.send(("ready",))
    while True:
        message = conn.recv()
        if message is None:
            return
        method, case, prefill = message
        try:
            result, writes = _method(method)(adapter, case, prefill)
            conn.send(("ok", result, writes))
        except Declined as declined:
            conn.send(("declined", str(declined), ""))
        except Exception as error:  # noqa: BLE001 - any kernel error is a finding, reported back
            conn.send(("error", f"{type(error).__name__}: {error}", traceback.format_exc(limit=4)))


def _method(name: str) -> Callable[[Any, Any, str], tuple[Any, tuple[str, ...]]]:
    """What a worker message runs: the forward (``run``) or the backward (``backward``)."""
    if name == "backward":
        from attention_crossval.kernel.harness_backward import execute_backward

        return execute_backward
    return execute


@dataclass
class IsolatedKernel:
    """A kernel living in a spawned worker process; restarted after a crash, hang or CUDA error.

    ``timeout_s`` limits one call; ``start_timeout_s`` limits the worker's start (until ready).
    """

    kernel: str
    timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    _process: Any = field(default=None, repr=False)
    _conn: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a number of seconds > 0")

    def call(
        self, case: Any, prefill: str, *, method: str = "run"
    ) -> tuple[AttentionResult | Gradients, tuple[str, ...]]:
        """Run ``case`` in the worker (started first if needed) and return its answer:
        ``method`` "run" is the forward, "backward" the backward (a ``BackwardCase``)."""
        if self._process is None or not self._process.is_alive():
            self._start()
        reply = self._request((method, case, prefill), self.timeout_s, "hang")
        if reply[0] == "declined":
            raise Declined(reply[1])
        if reply[0] == "error":
            if any(
                word in reply[1].lower() for word in ("cuda", "illegal", "device-side", "launch")
            ):
                self.close(kill=True)  # the CUDA context may be corrupt: next call gets a fresh one
            raise KernelCrashed("error", f"{reply[1]}\n{reply[2]}")
        _, result, writes = reply
        return result, writes

    def _request(self, message: tuple | None, timeout_s: float, what: str) -> tuple:
        """Send ``message`` (None: only wait) and receive the reply within ``timeout_s``."""
        try:
            if message is not None:
                self._conn.send(message)
            if not self._conn.poll(timeout_s):
                self.close(kill=True)
                raise KernelCrashed(
                    "timeout", f"no answer within {timeout_s:g} s ({what}); worker killed"
                )
            return self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            self._process.join(timeout=5)
            code = self._process.exitcode
            self.close(kill=True)
            raise KernelCrashed("crash", f"worker process died (exit code {code})") from None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_worker_main, args=(self.kernel, child), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        self._request(None, self.start_timeout_s, "worker start: spawn, imports, kernel set-up")

    def close(self, *, kill: bool = False) -> None:
        """Stop the worker: politely (it finishes its loop) unless ``kill``."""
        if self._process is None:
            return
        if not kill and self._process.is_alive():
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
