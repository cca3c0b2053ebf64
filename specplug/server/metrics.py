"""The server's Prometheus metrics: HTTP-side counters, and the engine's figures read at scrape time."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specplug.server.worker import EngineWorker

if TYPE_CHECKING:
    from specplug.server.prompts import Prompts


class Metrics:
    """Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

    def __init__(self, worker: EngineWorker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specplug_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specplug_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("specplug_completion_tokens", "Tokens returned to clients", registry=r)
        self.ttft = Histogram("specplug_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.step_seconds = Histogram("specplug_step_seconds", "Time per engine step (admissions + one verify)",
                                      registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.rejected = Counter("specplug_rejected_requests", "Requests refused because the queue was full", registry=r)
        self.engine_failures = Counter("specplug_engine_failures", "Engine steps that raised (the engine then stops "
                                       "serving)", registry=r)
        self.engine_stalls = Counter("specplug_engine_stalls", "Engine steps that ran over step_timeout_s (the engine "
                                     "then stops serving)", registry=r)
        self._worker = worker
        self.prompts: Prompts | None = None
        # (speculator, head) -> (drafted, accepted, drafts) of heads replaced by a reload
        self._retired: dict[tuple[str, str], tuple[int, int, int]] = {}
        r.register(self)  # the engine-side figures are read at scrape time

    def retire(self, name: str, head: str, stats) -> None:
        """Keep the acceptance counts of a speculator replaced by a reload under its head's label, so
        that /metrics shows the old head's figures beside the new one's (a before/after)."""
        d, a, n = self._retired.get((name, head), (0, 0, 0))
        self._retired[(name, head)] = (d + stats.drafted_tokens, a + stats.accepted_tokens, n + stats.drafts)

    def collect(self):
        w = self._worker
        eng = w.engine
        yield GaugeMetricFamily("specplug_requests_running", "Requests in a sequence slot", value=eng.n_running)
        yield GaugeMetricFamily("specplug_requests_waiting", "Requests queued for a slot (queue depth)",
                                value=w.waiting)
        yield GaugeMetricFamily("specplug_slots", "Sequence slots (parallel)", value=eng.n_parallel)
        yield GaugeMetricFamily("specplug_engine_up", "1 while the engine serves, 0 once it died or stalled",
                                value=0.0 if w.failure is not None else 1.0)
        if self.prompts is not None:
            yield CounterMetricFamily("specplug_prompt_rejected_requests", "Requests refused because no prompt worker "
                                      "was free (429 / 503)", value=self.prompts.rejected)
        if w.recorder is not None:
            yield from self._recording(w.recorder.stats)
        st = eng.stats
        yield CounterMetricFamily("specplug_target_forwards", "Decoding forwards of the target",
                                  value=st.target_forwards)
        yield CounterMetricFamily("specplug_emitted_tokens", "Tokens the target produced, stop tokens included",
                                  value=st.emitted_tokens)
        yield GaugeMetricFamily("specplug_mean_accepted_length", "Tokens per decoding forward over all requests",
                                value=st.emitted_tokens / st.target_forwards if st.target_forwards else 0.0)
        yield from self._acceptance(eng.specs)
        yield from self._speculators(eng.specs)

    def _acceptance(self, specs):
        """Acceptance per speculator and head file (`head`: its sha256 prefix, "" without one): a head
        swapped in by a reload starts its own series, the old one's stays (Metrics.retire)."""
        labels = ["speculator", "head"]
        drafted = CounterMetricFamily("specplug_spec_drafted_tokens", "Draft tokens verified", labels=labels)
        accepted = CounterMetricFamily("specplug_spec_accepted_tokens", "Draft tokens accepted", labels=labels)
        drafts = CounterMetricFamily("specplug_spec_drafts", "Drafts verified", labels=labels)
        rate = GaugeMetricFamily("specplug_spec_acceptance_rate", "Accepted / drafted tokens", labels=labels)
        mal = GaugeMetricFamily("specplug_spec_mean_accepted_length",
                                "Tokens per forward when this speculator's draft was verified", labels=labels)
        totals = dict(self._retired)
        for s in specs:
            key = (s.name, self._worker.heads.get(s.name, ""))
            d, a, n = totals.get(key, (0, 0, 0))
            totals[key] = (d + s.stats.drafted_tokens, a + s.stats.accepted_tokens, n + s.stats.drafts)
        for key, (d, a, n) in totals.items():
            drafted.add_metric(key, d)
            accepted.add_metric(key, a)
            drafts.add_metric(key, n)
            rate.add_metric(key, a / d if d else 0.0)
            mal.add_metric(key, (a + n) / n if n else 0.0)
        yield from (drafted, accepted, drafts, rate, mal)

    @staticmethod
    def _speculators(specs):
        """Per speculator: running or disabled, time and calls per hook, steps asked and possible
        (these restart at a reload, with the speculator)."""
        enabled = GaugeMetricFamily("specplug_spec_enabled", "1 while the speculator runs, 0 once disabled",
                                    labels=["speculator"])
        hook_s = CounterMetricFamily("specplug_spec_hook_seconds", "Time in each hook of the speculator (every "
                                     "sequence waits for it)", labels=["speculator", "hook"])
        hook_calls = CounterMetricFamily("specplug_spec_hook_calls", "Calls of each hook of the speculator",
                                         labels=["speculator", "hook"])
        asked = CounterMetricFamily("specplug_spec_asked_steps", "Sequence-steps the speculator was asked to draft "
                                    "(the others of spec_possible_steps: paused, or no draft could pay)",
                                    labels=["speculator"])
        possible = CounterMetricFamily("specplug_spec_possible_steps", "Sequence-steps the speculator could have "
                                       "drafted for", labels=["speculator"])
        for s in specs:
            ss = s.stats
            for hook, sec in list(ss.hook_s.items()):
                hook_s.add_metric([s.name, hook], sec)
                hook_calls.add_metric([s.name, hook], ss.hook_calls.get(hook, 0))
            asked.add_metric([s.name], ss.asked)
            possible.add_metric([s.name], ss.seq_steps)
            enabled.add_metric([s.name], 1.0 if s.enabled else 0.0)
        yield from (enabled, hook_s, hook_calls, asked, possible)

    @staticmethod
    def _recording(st):
        """The recorder's counts (`--record`): what reached the disk, and what a failed write lost."""
        yield CounterMetricFamily("specplug_recorded_requests", "Finished requests written to the --record folder",
                                  value=st.requests)
        yield CounterMetricFamily("specplug_recorded_tokens", "Tokens (prompt and answer) written to the --record "
                                  "folder", value=st.tokens)
        yield CounterMetricFamily("specplug_record_failed_writes", "Writes to the --record folder that failed (the "
                                  "requests they carried are not recorded; answers are unaffected)",
                                  value=st.failed_writes)
        yield CounterMetricFamily("specplug_record_lost_tokens", "Tokens of requests not recorded because their "
                                  "write failed", value=st.lost_tokens)
