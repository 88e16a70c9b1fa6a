"""`/metrics` shows the CPU kernels' instruction-set level and the machine's flags
(`pagedllm:cpu_isa_info`, from `get_stats()`'s `cpu_isa` and `cpu_isa_flags`)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.entrypoints.metrics import _EngineCollector


def _families(stats: dict) -> dict:
    engine = SimpleNamespace(scheduler=SimpleNamespace(block_size=16))
    server = SimpleNamespace(engine=engine, snapshot=SimpleNamespace(stats=stats))
    return {f.name: f for f in _EngineCollector(server).collect()}


def test_metrics_label_the_cpu_isa_level_and_flags():
    info = _families({"cpu_isa": "avx2", "cpu_isa_flags": ["avx2", "fma", "f16c"]})
    sample = info["pagedllm:cpu_isa_info"].samples[0]
    assert sample.labels == {"level": "avx2", "flags": "avx2 fma f16c"}
    assert sample.value == 1.0


def test_an_engine_off_the_cpu_has_no_cpu_isa_family():
    assert "pagedllm:cpu_isa_info" not in _families({})
