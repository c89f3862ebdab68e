"""Engine-side stand-ins for the worker actors: the engine sees a verifier and a proposer, and the
calls go to actors on their own core groups.

Each round makes one call to each worker that has work (a round in which no sequence drafts never
calls the draft). By default that is an ordinary actor call (~0.7 ms a hop here), whose waiting side
sleeps; ``exchange: compiled_graph`` uses a Ray Compiled Graph per worker instead (~0.1 ms a hop),
whose channel readers poll, so the replica and each worker hold most of a core even when idle: on a
host with few cores that slows the model more than the hop saves. Admission and removal of sequences
are ordinary actor calls either way.

The draft takes a sequence in the background: its prompt's prefill runs on the draft's cores while
the target goes on (with ordinary calls the actor runs them in the order sent, so what follows
finds the sequence there); the sequence drafts from the first round after the draft has it, and
until then decodes plainly. Not where the draft's forwards take every core of the host (a heavy draft
on a small CPU host, ``WorkerInfo.every_core``): a prefill there beside the target's work stalls both,
each forward's threads waiting on the other's, so the replica waits for it and the sequence drafts
from the next round. Outcomes of rounds in which nothing drafts are handed to the draft every
``PENDING_FLUSH`` rounds, so a plain stretch neither piles them up in the replica nor leaves them all
to the next proposal.

A failing draft never fails a request: its sequences continue with plain decoding, a new draft
actor is started in the same placement-group bundle, and sequences admitted after it is up use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayError

from serve_app.speculation.proposers.base import Drafted, Proposer, nothing_drafted
from serve_app.speculation.types import ProposalBlock, SamplingParams, VerifyResult
from serve_app.speculation.verifier import Verifier

log = logging.getLogger(__name__)

ROUND_TIMEOUT_S = 120.0  # a round far longer than this means a hung worker, not a slow one
MAX_DRAFT_RESTARTS = 3  # past this the replica decodes plainly until it is replaced
PENDING_FLUSH = 16  # outcomes of plain rounds handed to the draft this many at a time


class WorkerError(RuntimeError):
    """A worker died, hung or raised; the message names which (for the log, never for clients).
    ``lost``: the worker is gone or hung (a new one can take over), not a call that raised."""

    def __init__(self, message: str, lost: bool = False):
        super().__init__(message)
        self.lost = lost

    @classmethod
    def of(cls, role: str, error: Exception) -> WorkerError:
        lost = isinstance(error, (ActorDiedError, ActorUnavailableError, GetTimeoutError))
        return cls(f"{role} worker failed: {type(error).__name__}: {error}", lost)


class RoundChannel:
    """Calls one method of one actor once per round."""

    def __init__(self, actor: Any, method: str, compiled: bool):
        self.actor, self.method = actor, method
        self.dag = None
        if compiled:
            from ray.dag import InputNode

            with InputNode() as inp:
                node = getattr(actor, method).bind(inp)
            self.dag = node.experimental_compile()

    def __call__(self, arg: Any) -> Any:
        return self.send(arg)()

    def send(self, arg: Any) -> Callable[[], Any]:
        """Start the call; the returned function waits for its result."""
        ref = self.dag.execute(arg) if self.dag is not None else getattr(self.actor, self.method).remote(arg)
        return lambda: ray.get(ref, timeout=ROUND_TIMEOUT_S)

    def close(self) -> None:
        if self.dag is not None:
            try:
                self.dag.teardown()
            except Exception:  # noqa: BLE001 - tearing down after a worker died may itself fail
                log.debug("teardown of a compiled graph failed", exc_info=True)
            self.dag = None


class RemoteVerifier(Verifier):
    """The engine's target side, on a ``TargetWorker`` actor. ``restart`` replaces a lost actor with a
    new one in the same placement-group bundle (the engine then re-admits its requests)."""

    def __init__(self, spawn: Callable[[], Any], max_batch_size: int, compiled: bool):
        """``spawn()`` creates a TargetWorker actor (in this replica's placement group)."""
        self.spawn, self.compiled = spawn, compiled
        self.max_batch_size = max_batch_size
        self.active: set[str] = set()
        self.actor = spawn()
        self.info = self._call(self.actor.info.remote())  # waits for the model to load; raises its error
        self.channel = RoundChannel(self.actor, "verify", compiled)
        # Plain rounds may be sent ahead (Engine) only where the actor runs calls in the order sent:
        # a compiled graph runs its rounds on a thread of its own, unordered with add/remove calls.
        self.can_send_ahead = not compiled

    @staticmethod
    def _call(ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except (RayError, GetTimeoutError) as e:
            raise WorkerError.of("target", e) from e

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.active)

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     prefill: int | None = None) -> int | None:
        first = self._call(self.actor.add_sequence.remote(seq_id, list(prompt_ids), params, prefill=prefill),
                           ROUND_TIMEOUT_S)
        self.active.add(seq_id)
        return first

    def continue_prefill(self, seq_id: str, count: int | None = None) -> int | None:
        return self._call(self.actor.continue_prefill.remote(seq_id, count), ROUND_TIMEOUT_S)

    def take_features(self, seq_ids: Sequence[str]) -> list[torch.Tensor]:
        return self._call(self.actor.take_features.remote(list(seq_ids)), ROUND_TIMEOUT_S)

    def remove_sequence(self, seq_id: str) -> None:
        if seq_id in self.active:
            self.active.discard(seq_id)
            self.actor.remove_sequence.remote(seq_id)  # ordered before any later add on this actor

    def verify(self, block: ProposalBlock) -> VerifyResult:
        return self.verify_async(block)()

    def verify_async(self, block: ProposalBlock) -> Callable[[], VerifyResult]:
        """Send a round now; the returned function waits for its result (the engine pipelines plain rounds)."""
        try:
            wait = self.channel.send(block)
        except (RayError, GetTimeoutError) as e:
            raise WorkerError.of("target", e) from e

        def result() -> VerifyResult:
            try:
                return wait()
            except (RayError, GetTimeoutError) as e:
                raise WorkerError.of("target", e) from e

        return result

    def restart(self, timeout_s: float) -> None:
        """Replace the actor: kill what is left of it, start a new one in its bundle and wait at most
        ``timeout_s`` for its model to load. Every sequence is gone; raises ``WorkerError`` on failure."""
        self.channel.close()
        self.active.clear()
        try:
            ray.kill(self.actor)  # a hung actor must free its bundle; a dead one is gone already
        except Exception:  # noqa: BLE001
            pass
        self.actor = self.spawn()
        self.info = self._call(self.actor.info.remote(), timeout_s)
        self.channel = RoundChannel(self.actor, "verify", self.compiled)

    def close(self) -> None:
        self.channel.close()


class RemoteDraftProposer(Proposer):
    """The draft proposer, on a ``DraftWorker`` actor, with fallback to plain decoding."""

    def __init__(self, spawn: Callable[[], Any], compiled: bool,
                 on_state: Callable[[bool], None] = lambda available: None, decoder: bool = False):
        """``spawn()`` creates a new DraftWorker actor (in this replica's placement group). ``decoder``:
        its proposer is a decoder draft model, which drafts ahead (``engine.ahead``), not an EAGLE head,
        which reads the target's features (``Proposer.reads_features``)."""
        self.spawn, self.compiled, self.on_state = spawn, compiled, on_state
        self.can_propose_ahead, self.reads_features = decoder, not decoder
        self.can_add_later = True  # at any point of a sequence's life (``Proposer.can_add_later``)
        self.reads_late = True  # a decoder draft or an EAGLE head
        self.on_draft: set[str] = set()  # sequences the current draft actor holds
        self.adding: dict[str, Any] = {}  # sequences sent to it, not confirmed yet: their add calls' refs
        self.pending: list[VerifyResult] = []  # outcomes the draft has not seen yet
        self.failures = 0
        self.actor: Any = spawn()
        try:
            self.info = ray.get(self.actor.info.remote())  # waits for the model to load; raises its error
        except RayError as e:
            raise WorkerError.of("draft", e) from e
        # a compiled graph's rounds are not ordered after ordinary calls: admission waits there too
        self.prefills_aside = not compiled and not self.info.every_core
        self.channel: RoundChannel | None = RoundChannel(self.actor, "propose", compiled)
        self._starting: Any = None  # ping of a draft being restarted

    @property
    def available(self) -> bool:
        return self.channel is not None

    @property
    def busy(self) -> bool:
        """A sequence's prefill is running on the draft's cores (which the target's share on a small host)."""
        self._settle()
        return bool(self.adding)

    def add_sequence(self, seq_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                     features: torch.Tensor | None = None) -> None:
        if self.channel is None and not self._restarted():
            return  # decoded plainly: no draft yet
        if self.pending:  # outcomes of a sequence that held this id before (a requeued one) must not reach the new one
            self._hand_over()
        ref = self.actor.add_sequence.remote(seq_id, list(prompt_ids), params, features)
        if self.prefills_aside:
            self.adding[seq_id] = ref  # the actor prefills it while the target goes on (``_settle``)
            return
        try:
            ray.get(ref, timeout=ROUND_TIMEOUT_S)
            self.on_draft.add(seq_id)
        except (RayError, GetTimeoutError) as e:
            self._fail(e)

    def _settle(self) -> None:
        """Sequences whose admission the actor has finished draft from now on; a failed one fails the draft."""
        if not self.adding:
            return
        refs = list(self.adding.values())
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for seq_id, ref in list(self.adding.items()):
            if ref in done:
                del self.adding[seq_id]
                try:
                    ray.get(ref)
                except RayError as e:
                    self._fail(e)
                    return
                self.on_draft.add(seq_id)

    def _hand_over(self) -> None:
        """Send the outcomes the draft has not seen (an ordinary call, ordered before what follows)."""
        self.actor.observe.remote(tuple(self.pending))
        self.pending.clear()

    def remove_sequence(self, seq_id: str) -> None:
        if seq_id in self.on_draft or seq_id in self.adding:
            self.on_draft.discard(seq_id)
            self.adding.pop(seq_id, None)
            self.actor.remove_sequence.remote(seq_id)

    def propose(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> ProposalBlock:
        self._settle()
        counts = tuple(k if s in self.on_draft else 0 for s, k in zip(seq_ids, num_tokens, strict=True))
        if self.channel is not None and any(counts):
            try:
                block = self.channel((tuple(self.pending), tuple(seq_ids), counts))
                self.pending.clear()
                return block
            except (RayError, GetTimeoutError) as e:
                self._fail(e)
        return ProposalBlock.make_dummy(seq_ids, [[] for _ in seq_ids])

    def propose_ahead(self, seq_ids: Sequence[str], num_tokens: Sequence[int]) -> Callable[[], Drafted]:
        """Start drafting the next blocks on the actor (an ordinary call: it runs while the target
        verifies); the returned function waits for (guesses, blocks)."""
        self._settle()
        counts = tuple(k if s in self.on_draft else 0 for s, k in zip(seq_ids, num_tokens, strict=True))
        nothing = nothing_drafted(seq_ids)
        if self.channel is None or not any(counts):
            return lambda: nothing
        ref = self.actor.propose_ahead.remote((tuple(self.pending), tuple(seq_ids), counts))
        self.pending.clear()

        def wait() -> Drafted:
            try:
                return ray.get(ref, timeout=ROUND_TIMEOUT_S)
            except (RayError, GetTimeoutError) as e:
                self._fail(e)
                return nothing

        return wait

    def observe(self, result: VerifyResult) -> None:
        if self.on_draft or self.adding:
            self.pending.append(result)
            if len(self.pending) >= PENDING_FLUSH and not self.compiled and self.channel is not None:
                self._hand_over()

    def _fail(self, error: Exception) -> None:
        self.failures += 1
        log.error("draft worker failed (%s: %s); its sequences continue with plain decoding, restarting it",
                  type(error).__name__, error)
        self.on_draft.clear()
        self.adding.clear()
        self.pending.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.on_state(False)
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - it may already be gone
            pass
        if self.failures <= MAX_DRAFT_RESTARTS:
            self.actor = self.spawn()
            self._starting = self.actor.ping.remote()

    def _restarted(self) -> bool:
        """Non-blocking: is the restarted draft up? Then wire it in."""
        if self._starting is None:
            return False
        ready, _ = ray.wait([self._starting], timeout=0)
        if not ready:
            return False
        self._starting = None
        try:
            ray.get(ready[0])
            self.channel = RoundChannel(self.actor, "propose", self.compiled)
        except RayError as e:
            self._fail(e)
            return False
        log.warning("draft worker restarted; new sequences use it again")
        self.on_state(True)
        return True

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
