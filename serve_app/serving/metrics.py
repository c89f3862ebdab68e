"""Prometheus metrics through Ray's metrics API (exported by every Ray node, prefixed ``ray_``).

Names follow vLLM's where one exists (``vllm:spec_decode_num_drafts`` ->
``serve_app_spec_decode_num_drafts``, and so on):

- ``serve_app_requests`` (finish_reason), ``serve_app_prompt_tokens``, ``serve_app_generation_tokens``
- ``serve_app_spec_decode_num_drafts``: rounds in which a sequence had draft tokens
- ``serve_app_spec_decode_num_draft_tokens`` / ``..._num_accepted_tokens``: proposed / accepted;
  acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts
- ``serve_app_spec_decode_num_accepted_tokens_per_pos`` (position): accepted at draft position j
- ``serve_app_spec_decode_sequence_rounds`` (k): sequence-rounds by the block size they drafted (0:
  plain), what the k policy chose
- ``serve_app_spec_decode_round_latency_seconds``: one draft + verify round of the whole batch
- ``serve_app_time_to_first_token_seconds``, ``serve_app_inter_token_latency_seconds``
- ``serve_app_draft_worker_available`` (1/0) and ``serve_app_draft_worker_failures``
- ``serve_app_target_worker_restarts`` (outcome: resumed / failed) and
  ``serve_app_target_worker_resume_seconds``: a lost target worker replaced, its requests resumed
- ``serve_app_num_requests_running`` / ``serve_app_num_requests_waiting`` (vLLM's names)
- ``serve_app_spec_decode_policy_k`` (batch): the k the last round at that batch bucket drafted (1, 2,
  4, 8, 16: ``speculation.arms.bucket``), and ``serve_app_spec_decode_realized_tokens_per_second``
  (batch, k): what each k realized there lately, result to result (only k's tried lately)

Gauges vanish from Ray's exporter a few seconds after their last write, so the engine loop calls
``refresh`` about once a second.
"""

from __future__ import annotations

from ray.util import metrics

from serve_app.speculation.types import VerifyResult

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24]
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 51.2]


class ReplicaMetrics:
    """What a replica and its engine loop report. This base records nothing: the null object for
    replicas and loops built without Serve (tests, tools); ``ServingMetrics`` exports it all."""

    def on_round(self, result: VerifyResult, seconds: float) -> None:
        pass

    def on_draft_state(self, available: bool) -> None:
        pass

    def on_target_restart(self, resumed: bool, seconds: float) -> None:
        pass

    def refresh(self, running: int, waiting: int, realized: dict | None = None) -> None:
        """Gauges, about once a second; ``realized``: the k policy's ``RealizedRates.snapshot()``."""

    def on_admitted(self, prompt_tokens: int) -> None:
        pass

    def on_first_token(self, seconds: float) -> None:
        """Arrival to the first generated token."""

    def on_next_tokens(self, n: int, seconds_each: float) -> None:
        """``n`` tokens after the first, ``seconds_each`` apart."""

    def on_finished(self, finish_reason: str, tokens: int) -> None:
        pass


class ServingMetrics(ReplicaMetrics):
    def __init__(self, model_name: str):
        self.tags = {"model_name": model_name}
        keys = ("model_name",)
        self.requests = metrics.Counter("serve_app_requests", "Finished requests.", keys + ("finish_reason",))
        self.prompt_tokens = metrics.Counter("serve_app_prompt_tokens", "Prompt tokens of admitted requests.", keys)
        self.generation_tokens = metrics.Counter("serve_app_generation_tokens", "Generated tokens.", keys)
        self.num_drafts = metrics.Counter(
            "serve_app_spec_decode_num_drafts", "Sequence-rounds that carried draft tokens.", keys)
        self.num_draft_tokens = metrics.Counter(
            "serve_app_spec_decode_num_draft_tokens", "Draft tokens proposed.", keys)
        self.num_accepted_tokens = metrics.Counter(
            "serve_app_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.", keys)
        self.accepted_per_pos = metrics.Counter(
            "serve_app_spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
            keys + ("position",))
        self.sequence_rounds = metrics.Counter(
            "serve_app_spec_decode_sequence_rounds", "Sequence-rounds by the block size k they drafted (0: plain).",
            keys + ("k",))
        self.round_latency = metrics.Histogram(
            "serve_app_spec_decode_round_latency_seconds", "Wall time of one draft + verify round.",
            LATENCY_BUCKETS, keys)
        self.ttft = metrics.Histogram(
            "serve_app_time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS, keys)
        self.itl = metrics.Histogram(
            "serve_app_inter_token_latency_seconds", "Time per generated token after the first.",
            LATENCY_BUCKETS, keys)
        self.draft_available = metrics.Gauge(
            "serve_app_draft_worker_available", "1 while the replica's draft worker serves, else 0.", keys)
        self.running = metrics.Gauge("serve_app_num_requests_running", "Requests in the running batch.", keys)
        self.waiting = metrics.Gauge("serve_app_num_requests_waiting", "Requests waiting for a slot.", keys)
        self.policy_k = metrics.Gauge(
            "serve_app_spec_decode_policy_k", "The k the last round at this batch bucket drafted (0: plain).",
            keys + ("batch",))
        self.realized_rate = metrics.Gauge(
            "serve_app_spec_decode_realized_tokens_per_second",
            "Tokens per second that rounds drafting k realized lately at this batch bucket.", keys + ("batch", "k"))
        self._draft_available: int | None = None
        self.draft_failures = metrics.Counter(
            "serve_app_draft_worker_failures", "Draft worker failures (the replica fell back or restarted).", keys)

        self.target_restarts = metrics.Counter(
            "serve_app_target_worker_restarts", "Target workers lost and replaced (outcome: resumed / failed).",
            keys + ("outcome",))
        self.resume_seconds = metrics.Histogram(
            "serve_app_target_worker_resume_seconds", "From a lost target worker to its requests resumed.",
            TTFT_BUCKETS + [102.4, 204.8, 409.6], keys)

    def on_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens, self.tags)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds, self.tags)

    def on_next_tokens(self, n: int, seconds_each: float) -> None:
        for _ in range(n):
            self.itl.observe(seconds_each, self.tags)

    def on_finished(self, finish_reason: str, tokens: int) -> None:
        self.requests.inc(1, {**self.tags, "finish_reason": finish_reason})
        self.generation_tokens.inc(tokens, self.tags)

    def on_target_restart(self, resumed: bool, seconds: float) -> None:
        self.target_restarts.inc(1, {**self.tags, "outcome": "resumed" if resumed else "failed"})
        if resumed:
            self.resume_seconds.observe(seconds, self.tags)

    def on_round(self, result: VerifyResult, seconds: float) -> None:
        self.round_latency.observe(seconds, self.tags)
        drafted = result.num_draft_tokens
        accepted = result.num_accepted
        drafts = int((drafted > 0).sum())
        for k, n in enumerate(drafted.bincount().tolist()):
            if n:
                self.sequence_rounds.inc(n, {**self.tags, "k": str(k)})
        if drafts:
            self.num_drafts.inc(drafts, self.tags)
            self.num_draft_tokens.inc(int(drafted.sum()), self.tags)
            if int(accepted.sum()):
                self.num_accepted_tokens.inc(int(accepted.sum()), self.tags)
            for position in range(int(accepted.max())):
                n = int((accepted > position).sum())
                self.accepted_per_pos.inc(n, {**self.tags, "position": str(position)})

    def on_draft_state(self, available: bool) -> None:
        self._draft_available = 1 if available else 0
        self.draft_available.set(self._draft_available, self.tags)
        if not available:
            self.draft_failures.inc(1, self.tags)

    def refresh(self, running: int, waiting: int, realized: dict | None = None) -> None:
        self.running.set(running, self.tags)
        self.waiting.set(waiting, self.tags)
        for batch, arms in (realized or {}).items():
            self.policy_k.set(arms["k"], {**self.tags, "batch": batch})
            for k, rate in enumerate(arms["tokens_per_second"]):
                if rate is not None:
                    self.realized_rate.set(rate, {**self.tags, "batch": batch, "k": str(k)})
        if self._draft_available is not None:
            self.draft_available.set(self._draft_available, self.tags)
