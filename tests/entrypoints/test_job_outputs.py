"""`Job.outputs`: a one-prompt job's outputs straight from its queue (no task per output), in
order, merged when the client fell behind, cut by the job's timeout."""

from __future__ import annotations

import asyncio

from pagedllm.entrypoints.serving import Job
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams


class _Engine:
    def __init__(self, queue: asyncio.Queue) -> None:
        self.queue = queue
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:  # the engine ends the request as aborted
        self.aborted.append(request_id)
        self.queue.put_nowait(_output(2, "abort"))


class _Server:
    def __init__(self, engine) -> None:
        self.engine = engine


def _output(num_tokens: int, finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), None, None)
    completion.finish_reason = finish_reason
    return RequestOutput("r", "p", [1], [completion], finish_reason is not None)


def _job(queue: asyncio.Queue, timeout: float | None = None) -> Job:
    server = _Server(_Engine(queue))
    return Job(server, [("r", queue)], [], SamplingParams(), timeout)


async def _collect(job: Job) -> list[tuple[int, int, str | None]]:
    return [
        (index, len(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        async for index, out in job.outputs()
    ]


def test_one_prompt_job_yields_each_output_without_a_task_per_output():
    async def run():
        loop = asyncio.get_running_loop()
        created = []

        def factory(loop, coro, **kwargs):
            created.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)

        queue: asyncio.Queue = asyncio.Queue()
        job = _job(queue)

        async def feed():
            for n in range(1, 4):
                queue.put_nowait(_output(n, "length" if n == 3 else None))
                await asyncio.sleep(0)

        feeder = asyncio.ensure_future(feed())
        loop.set_task_factory(factory)
        try:
            got = await _collect(job)
        finally:
            loop.set_task_factory(None)
        await feeder
        return got, created

    got, created = asyncio.run(run())
    assert got == [(0, 1, None), (0, 2, None), (0, 3, "length")]
    assert created == []


def test_one_prompt_job_skips_to_the_latest_output_when_behind():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for n in (1, 2, 3):
            queue.put_nowait(_output(n))
        queue.put_nowait(_output(4, "length"))
        return await _collect(_job(queue))

    assert asyncio.run(run()) == [(0, 4, "length")]


def test_one_prompt_job_past_its_timeout_is_aborted_once_and_says_so():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_output(1))
        job = _job(queue, timeout=0.05)
        got = await _collect(job)
        return got, job.server.engine.aborted, job

    got, aborted, _ = asyncio.run(run())
    assert got == [(0, 1, None), (0, 2, "abort")]
    assert aborted == ["r"]


def test_one_prompt_job_reports_an_engine_failure_as_unavailable():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RuntimeError("the engine failed"))
        try:
            await _collect(_job(queue))
        except Exception as exc:  # noqa: BLE001 - the error is the point
            return exc
        return None

    exc = asyncio.run(run())
    assert exc is not None and getattr(exc, "status", None) == 503
