"""/metrics of kvrun serve in Prometheus' text format (prometheus-client, a registry of its own
per server so that tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvrun_requests",
            "Requests by outcome: ok, error, rejected (400/503), cancelled",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvrun_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("kvrun_generated_tokens", "Tokens generated", registry=r)
        self.active = Gauge("kvrun_sequences_active", "Sequences holding a slot", registry=r)
        self.waiting = Gauge("kvrun_sequences_waiting", "Sequences waiting for a slot", registry=r)
        self.kv_bytes = Gauge(
            "kvrun_kv_bytes", "Bytes the active sequences' KV caches hold", registry=r
        )
        self.kv_bytes_full = Gauge(
            "kvrun_kv_bytes_full", "Bytes full caches would hold for the same tokens", registry=r
        )
        self.cache_hits = Counter(
            "kvrun_prefix_cache_hits",
            "Requests that went on from a kept cache (--cache-mem)",
            registry=r,
        )
        self.cache_misses = Counter(
            "kvrun_prefix_cache_misses",
            "Requests that found no kept cache to go on from",
            registry=r,
        )
        self.cache_tokens = Counter(
            "kvrun_prefix_cache_tokens",
            "Prompt tokens taken from kept caches instead of prefilled",
            registry=r,
        )
        self.cache_evictions = Counter(
            "kvrun_prefix_cache_evictions",
            "Kept caches evicted to stay within --cache-mem",
            registry=r,
        )
        self.cache_bytes = Gauge(
            "kvrun_prefix_cache_bytes", "Bytes the kept caches hold (kv.nbytes())", registry=r
        )
        self.cache_entries = Gauge("kvrun_prefix_cache_entries", "Kept caches", registry=r)
        # the prefix cache on disk (--cache-dir): counted by the DiskCache, read at render
        self.disk = {
            name: Counter(f"kvrun_disk_cache_{name}", text, registry=r)
            for name, text in [
                ("hits", "Requests that went on from a .kvc file of --cache-dir"),
                ("misses", "Lookups in --cache-dir that found no file to go on from"),
                ("writes", "Kept caches written to --cache-dir"),
                ("evictions", "Files deleted to stay within --cache-disk"),
                ("hit_bytes", "Bytes of the files the hits loaded"),
            ]
        }
        self._disk_seen: dict[str, int] = {}
        self.disk_bytes = Gauge("kvrun_disk_cache_bytes", "Bytes of .kvc files kept", registry=r)
        self.disk_files = Gauge("kvrun_disk_cache_files", ".kvc files kept", registry=r)
        self.ttft_hist = Histogram(
            "kvrun_time_to_first_token_seconds",
            "From arrival to the first generated token",
            buckets=LATENCY,
            registry=r,
        )
        self.itl_hist = Histogram(
            "kvrun_inter_token_latency_seconds",
            "Between successive tokens of a sequence",
            buckets=LATENCY,
            registry=r,
        )

    # called from the engine thread (prometheus-client's metrics are thread-safe)
    def ttft(self, seconds: float) -> None:
        self.ttft_hist.observe(seconds)

    def itl(self, seconds: float) -> None:
        self.itl_hist.observe(seconds)

    def cache_lookup(self, tokens: int) -> None:
        """A lookup in the prefix cache: `tokens` reused (0: a miss)."""
        if tokens:
            self.cache_hits.inc()
            self.cache_tokens.inc(tokens)
        else:
            self.cache_misses.inc()

    def cache_evicted(self, n: int) -> None:
        if n:
            self.cache_evictions.inc(n)

    def ended(self, job, result, error: str | None) -> None:
        if result is not None:
            self.prompt_tokens.inc(result.stats.prompt_tokens)
            self.generated_tokens.inc(result.stats.generated_tokens)
        cancelled = error == "cancelled" or (
            result is not None and result.stats.stop_reason == "cancelled" and not job.stop.hit
        )
        self.requests.labels("cancelled" if cancelled else "error" if error else "ok").inc()

    def rejected(self) -> None:
        self.requests.labels("rejected").inc()

    def render(self, worker) -> bytes:
        """The text format, with the gauges read from the worker now."""
        self.waiting.set(worker.waiting)
        engine = worker.engine
        if engine is not None:
            self.active.set(engine.active)
            self.kv_bytes.set(engine.kv_bytes)
            self.kv_bytes_full.set(engine.kv_bytes_full)
        cache = worker.prefix_cache
        if cache is not None:
            self.cache_bytes.set(cache.bytes)
            self.cache_entries.set(len(cache))
        disk = getattr(worker, "disk_cache", None)
        if disk is not None:
            now = disk.stats()
            for name, counter in self.disk.items():
                counter.inc(now[name] - self._disk_seen.get(name, 0))
                self._disk_seen[name] = now[name]
            self.disk_bytes.set(now["bytes"])
            self.disk_files.set(now["files"])
        return generate_latest(self.registry)
