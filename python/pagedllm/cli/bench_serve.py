"""`pagedllm bench serve`: concurrent streaming clients against a running server.

Each request streams `/v1/completions` (EOS ignored, `output_len` tokens, usage included) with a
random prompt of `input_len` characters; arrivals are a Poisson process at `request_rate`
(inf: all at once), at most `max_concurrency` in flight. Reports request throughput, output
tokens/s and TTFT / TPOT / ITL (the gaps between a stream's chunks) / end-to-end latency
percentiles.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string
import time
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    # seconds between consecutive streamed chunks that carry text (inter-token latency)
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _prompt(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(length))


async def _one(client, url: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    ttft = None
    usage = None
    last = None
    itl = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    if usage is None:
        return RequestResult(False, error="no usage chunk in the stream")
    return RequestResult(
        True,
        ttft=ttft if ttft is not None else e2e,
        e2e=e2e,
        prompt_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        itl=itl,
    )


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{p}": math.nan for p in PERCENTILES} | {"mean": math.nan}
    ordered = sorted(values)
    out = {}
    for p in PERCENTILES:
        k = min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))
        out[f"p{p}"] = ordered[k]
    out["mean"] = sum(ordered) / len(ordered)
    return out


async def _bench(
    base_url, model, num_prompts, input_len, output_len, request_rate, max_concurrency, seed,
    api_key, progress,
) -> tuple[list[RequestResult], float]:  # fmt: skip
    import httpx

    rng = random.Random(seed)
    prompts = [_prompt(rng, input_len) for _ in range(num_prompts)]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/completions"
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_prompts, desc="Requests", unit="req", dynamic_ncols=True)
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=max_concurrency or num_prompts)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:

        async def run(prompt: str) -> RequestResult:
            body = {
                "prompt": prompt,
                "max_tokens": output_len,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if model:
                body["model"] = model
            if limit is None:
                result = await _one(client, url, body)
            else:
                async with limit:
                    result = await _one(client, url, body)
            if bar is not None:
                bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(run(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return list(results), elapsed


def run_bench_serve(
    *,
    base_url: str,
    model: str | None = None,
    num_prompts: int = 64,
    input_len: int = 128,
    output_len: int = 64,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    api_key: str | None = None,
    progress: bool = True,
) -> dict:
    """Runs the workload against the server at `base_url`; returns the figures and a summary."""
    if request_rate <= 0:
        raise ValueError(f"bench serve --request-rate must be > 0, got {request_rate}")
    results, elapsed = asyncio.run(
        _bench(
            base_url,
            model,
            num_prompts,
            input_len,
            output_len,
            request_rate,
            max_concurrency,
            seed,
            api_key,
            progress,
        )  # fmt: skip
    )
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    ms = lambda values: {k: 1000 * v for k, v in _percentiles(values).items()}  # noqa: E731
    result = {
        "num_prompts": num_prompts,
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "duration_s": elapsed,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok]),
    }

    def line(name: str) -> str:
        p = result[name]
        return (
            f"{name[:-3].upper():>5}: mean {p['mean']:.1f} ms, p50 {p['p50']:.1f}, "
            f"p90 {p['p90']:.1f}, p99 {p['p99']:.1f}"
        )

    result["summary"] = "\n".join(
        [
            f"{len(ok)}/{num_prompts} requests completed ({len(failed)} failed) in "
            f"{elapsed:.2f} s: {result['request_throughput']:.2f} req/s, "
            f"{result['output_throughput']:.1f} output tok/s",
            line("ttft_ms"),
            line("tpot_ms"),
            line("itl_ms"),
            line("e2e_ms"),
        ]
    )
    return result
