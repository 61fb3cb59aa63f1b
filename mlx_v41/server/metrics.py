"""The server's Prometheus metrics (`GET /metrics`, the text format, names prefixed `mlx_v41_`):
HTTP requests by route and status (a middleware), tokens and latencies (fed by the engine's
worker through `ServerMetrics` as the engine's observer), and what other objects count, read
when scraped: the queue, the batch, the KV budget, the prompt-cache store, DSpark drafts and
the streamed experts' cache (`model.expert_store.stats`).
"""

from __future__ import annotations

import time
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import Match

from .engine import Finish, Token

# Time to first token and between tokens: 1 ms (a decode step of a small model) to 60 s (a
# long prompt's prefill on a large one).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 60.0)
# A request's whole time: a long reply streams for minutes.
DURATION_BUCKETS = LATENCY_BUCKETS + (120.0, 300.0, 600.0)
UNMATCHED = "unmatched"  # the route label of a path no route serves (bounds the label's values)


class ServerMetrics:
    """One app's metrics in their own `CollectorRegistry`. As the engine's `observer`, its
    worker thread calls `started` when requests begin their prefill and `event` with each
    `Token` / `Finish` / exception a job is given; the middleware calls `answered`."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("mlx_v41_requests", "HTTP requests answered, by route and "
                                "status code", ["route", "status"], registry=registry)
        self.duration = Histogram("mlx_v41_request_duration_seconds", "HTTP request time, "
                                  "until the last byte of a streamed reply", ["route"],
                                  buckets=DURATION_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("mlx_v41_prompt_tokens", "prompt tokens of finished "
                                     "sequences", registry=registry)
        self.cached_tokens = Counter("mlx_v41_cached_prompt_tokens", "prompt tokens read from "
                                     "the prompt cache instead of prefilled", registry=registry)
        self.generated_tokens = Counter("mlx_v41_generation_tokens", "tokens generated",
                                        registry=registry)
        self.finished = Counter("mlx_v41_sequences_finished", "sequences (choices) ended, by "
                                "reason: stop, length, cancelled, error", ["reason"],
                                registry=registry)
        self.ttft = Histogram("mlx_v41_time_to_first_token_seconds", "from a sequence's "
                              "submission to its first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.itl = Histogram("mlx_v41_inter_token_latency_seconds", "between a sequence's "
                             "successive tokens (DSpark: a cycle's accepted tokens come "
                             "together)", buckets=LATENCY_BUCKETS, registry=registry)
        self.cache_hits = Counter("mlx_v41_prompt_cache_hits", "prompts that reused a cached "
                                  "prefix", registry=registry)
        self.cache_misses = Counter("mlx_v41_prompt_cache_misses", "prompts prefilled from "
                                    "the start", registry=registry)
        self.grammar_seconds = Counter("mlx_v41_grammar_mask_seconds", "time computing "
                                       "grammar masks (constrained decoding)",
                                       registry=registry)
        registry.register(_EngineCollector(engine, self))
        self.prefilling: weakref.WeakSet = weakref.WeakSet()  # jobs started, no token yet
        self.decoding: weakref.WeakSet = weakref.WeakSet()  # jobs with tokens, not finished
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # its last token

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ the engine's hooks

    def started(self, jobs: list, cached: int) -> None:
        """`jobs` (the choices of one prompt) begin their prefill; `cached` tokens reused."""
        (self.cache_hits if cached else self.cache_misses).inc()
        for job in jobs:
            self.prefilling.add(job)

    def event(self, job, item) -> None:
        """What the worker gives `job`: a `Token`, its `Finish` or the exception it failed
        with."""
        now = time.perf_counter()
        if isinstance(item, Token):
            last = self._last.get(job)
            if last is None:
                self.ttft.observe(now - job.submitted)
            else:
                self.itl.observe(now - last)
            self._last[job] = now
            self.prefilling.discard(job)
            self.decoding.add(job)
            return
        is_started = job in self.prefilling or job in self.decoding
        self.prefilling.discard(job)
        self.decoding.discard(job)
        self._last.pop(job, None)
        if not isinstance(item, Finish):
            self.finished.labels("error").inc()
            return
        self.finished.labels(item.reason).inc()
        if not is_started:  # cancelled while queued: no work done
            return
        self.prompt_tokens.inc(item.prompt_tokens)
        self.cached_tokens.inc(item.cached_tokens)
        self.generated_tokens.inc(item.completion_tokens)
        self.grammar_seconds.inc(sum(getattr(p, "mask_seconds", 0.0)
                                     for p in job.settings.processors))

    # ------------------------------------------------------------------ the middleware's hook

    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(seconds)


class _EngineCollector(Collector):
    """What the engine, its prompt-cache store and its model count, read at each scrape."""

    def __init__(self, engine, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics

    def collect(self):
        engine, metrics = self.engine, self.metrics
        prefilling, decoding = len(metrics.prefilling), len(metrics.decoding)
        yield _gauge("requests_waiting", "requests queued, not yet started",
                     max(engine.in_flight - prefilling - decoding, 0))
        yield _gauge("sequences_prefilling", "sequences whose prompt is being read", prefilling)
        yield _gauge("sequences_decoding", "sequences generating", decoding)
        if hasattr(engine, "kv_budget"):  # the batching engine
            yield _gauge("kv_reserved_bytes", "bytes the running sequences' caches may reach "
                         "(each at its prompt + max_tokens)", engine.kv_reserved)
            yield _gauge("kv_budget_bytes", "--kv-budget", engine.kv_budget)
        store = engine.store
        yield _gauge("prompt_cache_bytes", "bytes of cached prompt prefixes", store.nbytes)
        yield _gauge("prompt_cache_max_bytes", "--prompt-cache-bytes", store.max_bytes)
        yield _gauge("prompt_cache_entries", "cached prompt prefixes", len(store.entries))
        counters = engine.counters
        yield _counter("draft_tokens_proposed", "DSpark draft tokens proposed",
                       counters.drafts_proposed)
        yield _counter("draft_tokens_accepted", "DSpark draft tokens accepted",
                       counters.drafts_accepted)
        experts = getattr(engine.model, "expert_store", None)
        if experts is not None:  # streamed routed experts
            yield from _expert_counters(experts.stats)


def _expert_counters(stats):
    yield _counter("expert_cache_hits", "routed experts found resident", stats.hits)
    yield _counter("expert_cache_misses", "routed experts read from disk",
                   stats.routed - stats.hits)
    yield _counter("expert_bytes_read", "bytes of experts read from disk", stats.bytes_read)
    yield _counter("expert_wait_seconds", "time the forward waited for expert reads",
                   stats.wait_seconds)


def _gauge(name: str, documentation: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlx_v41_{name}", documentation, value=value)


def _counter(name: str, documentation: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"mlx_v41_{name}", documentation, value=value)


class RequestMetrics:
    """ASGI middleware: counts each HTTP request by its route's path (not the raw path, which
    a client chooses) and status code, and times it to its last byte. A request that a
    middleware answered (a 401) never reached the router: its route is looked up here."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, tic = 500, time.perf_counter()  # 500: it failed before answering

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.answered(_route(scope), status, time.perf_counter() - tic)


def _route(scope) -> str:
    route = scope.get("route")
    if route is None:
        route = next((r for r in scope["app"].router.routes
                      if r.matches(scope)[0] != Match.NONE), None)
    return getattr(route, "path", UNMATCHED)
