"""Runs the engine on its own thread and streams its outputs to asyncio callers.

The engine is synchronous (each round blocks on the workers); the replica's event loop must keep
serving HTTP meanwhile. Requests enter through a thread-safe queue; outputs go back to each
request's asyncio queue with ``call_soon_threadsafe``. A client that goes away aborts its request.

If a round fails, the loop first asks ``resume`` (the replica's: a lost target worker is replaced and
the requests in flight start over from their prompt plus what they have generated, so their streams
pause and go on). If that cannot help (another error, no new worker in time, or a second failure
before any round got through), every request in flight gets the error at once and the loop refuses
new work, so nothing hangs and Serve's health check replaces the replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from serve_app.engine.engine import Engine
from serve_app.engine.request import GenerationParams, RequestOutput
from serve_app.serving.metrics import ReplicaMetrics

log = logging.getLogger(__name__)
GAUGE_REFRESH_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine failed (a worker died); the replica must be replaced. Its message is what a client
    may see: what to do, nothing of the cause (actor ids, pids, addresses go to the log, under the
    request id the client also gets)."""

    def __init__(self, request_id: str | None = None):
        super().__init__("the model worker serving this request failed and this replica is being replaced; "
                         "retry the request")
        self.request_id = request_id


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    tokens_seen: int = 0


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ReplicaMetrics | None = None,
                 resume: Callable[[BaseException], bool] = lambda error: False):
        """``resume(error)``: try to recover from a failed round (True: the engine can go on)."""
        self.engine = engine
        self.metrics = metrics or ReplicaMetrics()
        self.resume = resume
        self.error: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._aborts: list[str] = []  # taken in during a step (``_arrivals``), applied at the next drain
        engine.admission.arrivals = self._arrivals
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet holding a KV-cache slot (approximate: read across threads)."""
        return max(0, len(self._streams) - self.engine.verifier.max_batch_size)

    def submit(self, prompt_ids: Sequence[int], params: GenerationParams,
               request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate and enqueue a request now (raising ``RequestError`` or ``EngineDeadError`` before
        any response starts), and return the stream of its outputs, one per round."""
        request_id = request_id or f"r{next(self._ids)}"
        if self.error is not None:
            raise EngineDeadError(request_id)
        self.engine.validate(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, list(prompt_ids), params))
        if self.error is not None:  # failed after the first check: _fail may not have seen this add
            self._streams.pop(request_id, None)
            raise EngineDeadError(request_id)
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    log.error("request %s failed: %s: %s", request_id, type(item).__name__, item)
                    raise EngineDeadError(request_id) from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller went away: free the slot
                self._commands.put(("abort", request_id))

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        refreshed = 0.0
        progressed = True  # a round got through since the last resume: a failure now is a new one
        while True:
            self._drain(block=not self.engine.has_work)
            if time.perf_counter() - refreshed > GAUGE_REFRESH_S:
                refreshed = time.perf_counter()
                self.metrics.refresh(len(self.engine.running), len(self.engine.waiting),
                                     self.engine.policy.snapshot().get("realized"))
            if not self.engine.has_work:
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - every in-flight request must hear of it
                if progressed and self._resumed(e):
                    progressed = False
                    continue
                self._fail(e)
                return
            progressed = progressed or bool(outputs)
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out, now)

    def _resumed(self, error: BaseException) -> bool:
        try:
            return self.resume(error)
        except Exception:  # noqa: BLE001 - recovery failing is one more reason to fail the requests
            log.exception("resuming after a failed round failed")
            return False

    def _arrivals(self) -> None:
        """Inside a step, after a prefill: queue the requests submitted meanwhile (``engine.admission``).
        Aborts wait for the next drain: the step holds sequences that an abort would release."""
        self._drain(block=False, in_step=True)

    def _drain(self, block: bool, in_step: bool = False) -> None:
        if not in_step:
            for request_id in self._aborts:
                self.engine.abort(request_id)
            self._aborts.clear()
        while True:
            try:  # an idle loop wakes up now and then to refresh gauges
                command = self._commands.get(block=block, timeout=GAUGE_REFRESH_S if block else None)
            except queue.Empty:
                return
            block = False
            if command[0] == "add":
                _, request_id, prompt_ids, params = command
                if request_id not in self._streams:
                    continue  # the client left before admission
                try:
                    self.engine.add_request(prompt_ids, params, request_id=request_id)
                    self.metrics.on_admitted(len(prompt_ids))
                except Exception as e:  # noqa: BLE001 - validated already; report anything else
                    self._push(request_id, e)
            elif command[0] == "abort" and in_step:
                self._aborts.append(command[1])
            elif command[0] == "abort":
                self.engine.abort(command[1])

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        new = len(out.token_ids) - stream.tokens_seen
        if new > 0:
            if stream.last_token_at is None:
                self.metrics.on_first_token(now - stream.arrival)
            else:
                self.metrics.on_next_tokens(new, (now - stream.last_token_at) / new)
            stream.last_token_at = now
        stream.tokens_seen = len(out.token_ids)
        if out.finished:
            self.metrics.on_finished(str(out.finish_reason), len(out.token_ids))
        self._push(out.request_id, out)

    def _push(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail(self, error: BaseException) -> None:
        log.error("engine round failed; failing all requests in flight", exc_info=error)
        self.error = error
        self.engine.abort_all()
        for request_id in list(self._streams):
            self._push(request_id, error)
        while True:  # requests queued meanwhile hear of it too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._push(command[1], error)
