"""`/metrics`: Prometheus text format, names prefixed `pagedllm:` and following vLLM's.

Gauges and engine counters are read from the engine loop's latest snapshot (taken in the engine
thread after each step, so a scrape never touches the engine); per-request histograms are fed by
each finished request. With the KV offload tier on, its hits and misses (prompt tokens), the
bytes it moved each way, its load latency histogram and its usage come from the same snapshot.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.kv_transfer.worker import LatencyHistogram
from pagedllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, engine) -> None:
        self.engine = engine
        # the tier counts blocks; its metrics count tokens
        self.block_size = engine.engine.scheduler.block_size

    def collect(self):
        stats = self.engine.snapshot.stats
        gauges = {
            "num_requests_running": ("num_running", "Requests in the running queue"),
            "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled"),
            "num_requests_swapped": ("num_swapped", "Requests swapped out to host memory"),
            "kv_cache_usage_perc": ("kv_usage", "Fraction of device KV-cache blocks in use (0-1)"),
        }
        for name, (key, doc) in gauges.items():
            yield GaugeMetricFamily(f"pagedllm:{name}", doc, value=float(stats.get(key, 0)))
        if "kv_cache_dtype" in stats:
            yield from _cache_metrics(stats, self.block_size)
        if "cpu_isa" in stats:
            yield _cpu_isa_info(stats)
        counters = {
            "prefix_cache_queries": (
                "prefix_cache_query_blocks",
                "Blocks looked up in the prefix cache",
            ),
            "prefix_cache_hits": ("prefix_cache_hits", "Blocks found in the prefix cache"),
            "num_preemptions": ("num_preemptions", "Preemptions since start"),
            "generation_tokens": ("generation_tokens", "Generated tokens since start"),
            # speculative decoding (vLLM's spec_decode counters)
            "spec_decode_num_drafts": ("spec_decode_num_drafts", "Draft runs verified"),
            "spec_decode_num_draft_tokens": (
                "spec_decode_num_draft_tokens",
                "Draft tokens verified",
            ),
            "spec_decode_num_accepted_tokens": (
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted",
            ),
        }
        for name, (key, doc) in counters.items():
            yield CounterMetricFamily(f"pagedllm:{name}", doc, value=float(stats.get(key, 0)))
        if "kv_offload_num_slots" in stats:
            yield from _offload_metrics(stats, self.block_size)
        if "moe_expert_tokens" in stats:
            yield _expert_tokens(stats["moe_expert_tokens"])


def _cache_metrics(stats, block_size: int):
    """What the KV cache is (vLLM's cache_config_info: its labels carry the config) and how many
    tokens it holds."""
    info = GaugeMetricFamily(
        "pagedllm:cache_config_info",
        "The KV cache's configuration (labels); value 1",
        labels=["kv_cache_dtype", "block_size"],
    )
    info.add_metric([str(stats["kv_cache_dtype"]), str(block_size)], 1.0)
    yield info
    yield GaugeMetricFamily(
        "pagedllm:kv_cache_num_tokens",
        "Tokens the device KV cache holds",
        value=float(stats["kv_cache_num_tokens"]),
    )


def _cpu_isa_info(stats) -> GaugeMetricFamily:
    """The instruction-set level the CPU kernels run at and the machine's flags (labels)."""
    info = GaugeMetricFamily(
        "pagedllm:cpu_isa_info",
        "The CPU kernels' instruction-set level and the machine's feature flags (labels); value 1",
        labels=["level", "flags"],
    )
    info.add_metric([stats["cpu_isa"], " ".join(stats["cpu_isa_flags"])], 1.0)
    return info


def _expert_tokens(per_layer: dict[int, list[int]]) -> CounterMetricFamily:
    """A mixture of experts' load balance: tokens routed to each expert of each MoE layer."""
    family = CounterMetricFamily(
        "pagedllm:moe_expert_tokens",
        "Tokens routed to each expert of each MoE layer (one per token and chosen expert)",
        labels=["layer", "expert"],
    )
    for layer, counts in per_layer.items():
        for expert, count in enumerate(counts):
            family.add_metric([str(layer), str(expert)], float(count))
    return family


def _offload_metrics(stats, block_size: int):
    """The KV offload tier's families (only while the tier is on)."""
    tokens = {
        "kv_offload_hit_tokens": ("kv_offload_hit_blocks", "Prompt tokens found in the tier"),
        "kv_offload_miss_tokens": (
            "kv_offload_missed_blocks",
            "Prompt tokens past the device hit that the tier did not hold",
        ),
    }
    for name, (key, doc) in tokens.items():
        yield CounterMetricFamily(f"pagedllm:{name}", doc, value=float(stats[key] * block_size))
    moved = {
        "kv_offload_bytes_loaded": "Bytes copied from the tier into the device cache",
        "kv_offload_bytes_saved": "Bytes copied from the device cache into the tier",
    }
    for key, doc in moved.items():
        yield CounterMetricFamily(f"pagedllm:{key}", doc, value=float(stats[key]))
    if "kv_offload_disk_io_errors" in stats:
        yield _disk_errors(stats)
    yield GaugeMetricFamily(
        "pagedllm:num_requests_waiting_for_remote_kvs",
        "Requests parked while their prefix loads from the tier",
        value=float(stats["num_waiting_for_remote_kvs"]),
    )
    used, slots = stats["kv_offload_used_slots"], stats["kv_offload_num_slots"]
    yield GaugeMetricFamily(
        "pagedllm:kv_offload_usage_perc",
        "Fraction of the tier's blocks in use (0-1)",
        value=used / slots if slots else 0.0,
    )
    yield GaugeMetricFamily(
        "pagedllm:kv_offload_used_blocks", "Blocks the tier holds", value=float(used)
    )
    counts = stats["kv_offload_load_latency_buckets"]
    buckets, total = [], 0
    for bound, count in zip(LatencyHistogram.BOUNDS, counts):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
    latency = HistogramMetricFamily(
        "pagedllm:kv_offload_load_latency_seconds",
        "Submitted to copied, per step's loads from the tier",
        buckets=buckets,
        sum_value=float(stats["kv_offload_load_latency_sum"]),
    )
    yield latency


def _disk_errors(stats) -> CounterMetricFamily:
    """The disk tier's failures, each of which it survives (the blocks are computed again)."""
    errors = CounterMetricFamily(
        "pagedllm:kv_offload_disk_errors",
        "Disk tier failures: io (an OS error: the folder deleted, read-only or full) and "
        "corrupt (a block file whose payload failed its checksum, deleted)",
        labels=["reason"],
    )
    errors.add_metric(["io"], float(stats["kv_offload_disk_io_errors"]))
    errors.add_metric(["corrupt"], float(stats["kv_offload_disk_corrupt_blocks"]))
    return errors


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.prompt_tokens = Counter(
            "pagedllm:prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.success = Counter(
            "pagedllm:request_success",
            "Finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "pagedllm:request_rejected", "Requests refused with 429 (admission control)", registry=r
        )
        self.ttft = Histogram(
            "pagedllm:time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pagedllm:time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        engine.on_finished.append(self.observe)

    def observe(self, output: RequestOutput) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.success.labels(finished_reason=completion.finish_reason or "unknown").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            generated = max(len(c.token_ids) for c in output.outputs)
            if m.last_token_time is not None and generated > 1:
                self.tpot.observe(
                    max(0.0, (m.last_token_time - m.first_token_time) / (generated - 1))
                )
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
