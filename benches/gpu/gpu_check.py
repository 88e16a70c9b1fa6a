"""The GPU check: the GPU part of the test suite, then three benchmarks, each stage in its own
process with its own time budget, so a stage that fails, hangs or breaks the CUDA context does
not stop the others. `benches/gpu/run.sh` calls it on a device machine; `--dry-run` runs the same
stages on the CPU (Triton interpreter, tiny sizes) so CI proves the plumbing.

    python benches/gpu/gpu_check.py --out DIR [--dry-run] [--stages env,tests,...]

Writes DIR/gpu_check.json (every stage's status, seconds and figures, rewritten as each stage
ends), DIR/gpu_check.log (every stage's output), DIR/tests.xml and DIR/tests_serial.xml (the
tests' JUnit reports) and DIR/gpu_check.md (the figures as a table for benches/RESULTS.md), and
prints a summary table last. Stages:

- env: device, versions, the measured device-to-device copy bandwidth (bytes read + written).
- tests: the GPU tests natively (kernels against their torch references, LoRA kernels,
  tests/gpu: the engine against transformers greedy on CUDA, CUDA graphs against eager,
  speculative decoding, structured output with the bitmask on the device).
- throughput: nano-vllm's bench workload (256 sequences, input and output lengths U[100, 1024],
  temperature 0.6, ignore_eos) on a Qwen3-0.6B-shaped random-weight bfloat16 checkpoint made
  here.
- hf_generate: transformers `generate` on a slice of the same prompts, for comparison.
- decode_step: one engine decode step at batch 256, context 1024 (eager and CUDA graph) against
  its byte floor: (weights + KV read) / copy bandwidth.
- attention: the decode attention kernel's achieved bandwidth against a device-to-device copy of
  the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Qwen3-0.6B's shape (its config.json), random weights
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
# the same architecture at a size the CPU runs in seconds
QWEN3_TINY = dict(
    QWEN3_0_6B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between a device run and the CPU dry run."""

    device: str
    dtype: str
    model: dict
    # throughput: nano-vllm's bench.py (num_seqs, max_input_len, max_output_len, lengths drawn
    # from U[100, max]); transformers runs the first `hf_seqs` prompts for `hf_new_tokens` each
    num_seqs: int
    min_len: int
    max_input_len: int
    max_output_len: int
    token_id_max: int
    hf_seqs: int
    hf_new_tokens: int
    # the engine's token budget per step (nano-vllm's default, 16384; None: ours)
    max_num_batched_tokens: int | None
    # decode_step and attention
    batch: int
    context: int
    block_size: int
    copy_bytes: int
    reps: int
    # the GPU tests to run, and pytest's worker count (0: no xdist)
    tests: tuple[str, ...]
    test_workers: int
    # run after, alone on the device (their engines size the cache from its free memory)
    serial_tests: tuple[str, ...]


DEVICE = Sizes(
    device="cuda",
    dtype="bfloat16",
    model=QWEN3_0_6B,
    num_seqs=256,
    min_len=100,
    max_input_len=1024,
    max_output_len=1024,
    token_id_max=10000,
    hf_seqs=64,
    hf_new_tokens=256,
    max_num_batched_tokens=16384,
    batch=256,
    context=1024,
    block_size=16,
    copy_bytes=2 << 30,
    reps=20,
    tests=(
        "tests/kernels/test_kernels.py",
        "tests/lora/test_lora_kernels.py",
        "tests/gpu",
    ),
    test_workers=4,
    serial_tests=("tests/lora/test_lora_parity.py::test_the_triton_kernels_drive_the_model",),
)
DRY_RUN = Sizes(
    device="cpu",
    dtype="float32",
    model=QWEN3_TINY,
    num_seqs=6,
    min_len=4,
    max_input_len=24,
    max_output_len=12,
    token_id_max=400,
    hf_seqs=2,
    hf_new_tokens=4,
    max_num_batched_tokens=None,
    batch=4,
    context=32,
    block_size=16,
    copy_bytes=8 << 20,
    reps=3,
    # the GPU tests (skipped: no CUDA), then a kernel test that runs under the interpreter
    tests=("tests/gpu",),
    test_workers=0,
    serial_tests=("tests/kernels/test_kernels.py::test_copy_blocks_kernel_matches_reference",),
)

# seconds per stage (device, dry run): the device run's total stays within 8 minutes; the dry
# run's only guard against a hang (a busy CI machine can take half a minute for the imports)
BUDGETS = {
    "env": (30, 180),
    "tests": (200, 240),
    "throughput": (100, 180),
    "hf_generate": (45, 180),
    "decode_step": (60, 180),
    "attention": (30, 180),
}
# the bound on one device run: every stage at its budget stays inside it
DEVICE_RUN_LIMIT_S = 8 * 60
STAGES = tuple(BUDGETS)
# seconds any one GPU test may take (where pytest-timeout is installed, as on the device)
TEST_TIMEOUT_S = 90


# --- helpers shared by the stages ----------------------------------------------------------


class Record:
    """A stage's figures, written to its JSON file at every `put` so that a stage killed at its
    budget still leaves what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {}

    def put(self, **items) -> None:
        self.data.update(items)
        for key, value in items.items():
            print(f"  {key} = {value}", flush=True)
        # whole or not at all: the stage may be killed at its budget mid-write
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits (a small positive figure never shows as 0)."""
    return float(f"{x:.{digits}g}")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device: str, reps: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` over `reps` runs after `warmup` (CUDA events on the device)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(sizes: Sizes) -> dict:
    """Device-to-device copy of `copy_bytes`: bytes read + written per second (the ceiling the
    byte floors are measured against)."""
    import torch

    src = torch.randn(sizes.copy_bytes // 4, device=sizes.device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), sizes.device, sizes.reps)
    torch.testing.assert_close(dst, src, rtol=0, atol=0)
    nbytes = 2 * src.numel() * src.element_size()
    return {
        "copy_bytes": nbytes,
        "copy_seconds": seconds,
        "copy_bw_GBps": sig(nbytes / seconds / 1e9),
    }


def make_checkpoint(sizes: Sizes, folder: Path) -> Path:
    """The Qwen3-shaped random-weight checkpoint (transformers' own initialisation), made once
    and reused by later stages. No tokenizer: the workloads are token ids."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**sizes.model)
    with torch.device(sizes.device):  # initialise on the device: seconds, not a minute
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, sizes.dtype))
    tmp = folder.with_suffix(".partial")
    model.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def checkpoint_name(sizes: Sizes) -> str:
    m = sizes.model
    return f"qwen3_{m['hidden_size']}x{m['num_hidden_layers']}_{sizes.dtype}"


def nanovllm_workload(sizes: Sizes, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: prompts of U[100, max_input_len] random ids below 10,000, each with
    U[100, max_output_len] output tokens."""
    rng = random.Random(seed)
    prompts = [
        [
            rng.randint(0, sizes.token_id_max)
            for _ in range(rng.randint(sizes.min_len, sizes.max_input_len))
        ]
        for _ in range(sizes.num_seqs)
    ]
    outputs = [rng.randint(sizes.min_len, sizes.max_output_len) for _ in range(sizes.num_seqs)]
    return prompts, outputs


# --- stages ----------------------------------------------------------------------------------


def stage_env(sizes: Sizes, rec: Record, work: Path) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    import pagedllm

    versions = {}
    for name in ("torch", "triton", "transformers", "llguidance"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "missing"
    rec.put(
        **versions,
        pagedllm_from=str(Path(pagedllm.__file__).parent),
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    if sizes.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        rec.put(
            device_name=props.name,
            sm_count=props.multi_processor_count,
            memory_GiB=sig(props.total_memory / 2**30),
            capability=f"{props.major}.{props.minor}",
        )
    else:
        rec.put(device_name="cpu")
    rec.put(**copy_bandwidth(sizes))


def stage_tests(sizes: Sizes, rec: Record, work: Path, out: Path, deadline: float) -> None:
    """The parallel run (pytest-xdist workers share the device), then the serial one (tests
    that size their cache from the device's free memory, so nothing else may run beside them).
    Counts and failures are summed over both."""
    runs = [("tests.xml", sizes.tests, sizes.test_workers)]
    if sizes.serial_tests:
        runs.append(("tests_serial.xml", sizes.serial_tests, 0))
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped", "passed"), 0)
    failed, codes = [], []
    for report_name, tests, workers in runs:
        code, counts, names = run_pytest(sizes, out / report_name, tests, workers, deadline)
        codes.append(code)
        failed += names
        for key in totals:
            totals[key] += counts[key]
        rec.put(**totals, failed=failed[:40], pytest_exits=codes)
    if any(codes):
        raise RuntimeError(f"pytest exits {codes}: {len(failed)} failed")


def run_pytest(
    sizes: Sizes, report: Path, tests: tuple[str, ...], workers: int, deadline: float
) -> tuple[int, dict, list[str]]:
    import importlib.util
    import xml.etree.ElementTree as ET

    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", f"--junitxml={report}", *tests]
    if workers and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(TEST_TIMEOUT_S)]  # one hung test must not take the stage
    print("  $ " + " ".join(cmd[1:]), flush=True)
    env = dict(os.environ)
    if sizes.device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # natively: the interpreter must not mask the kernels
    # pytest gets what is left of the stage's budget, less a margin to read its report
    budget = max(5.0, deadline - time.monotonic() - 5.0)
    code = run_bounded(cmd, budget, cwd=ROOT, env=env)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report {report.name} (exit {code})")
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return code, counts, failed


def stage_throughput(sizes: Sizes, rec: Record, work: Path) -> None:
    from pagedllm import LLM, SamplingParams

    folder = make_checkpoint(sizes, work / checkpoint_name(sizes))
    prompts, outputs = nanovllm_workload(sizes)
    rec.put(
        num_seqs=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(outputs),
    )
    t0 = time.perf_counter()
    llm = start_engine(
        rec,
        lambda eager: LLM(
            str(folder),
            dtype=sizes.dtype,
            device=sizes.device,
            skip_tokenizer_init=True,
            max_model_len=sizes.max_input_len + sizes.max_output_len,
            max_num_seqs=min(256, sizes.num_seqs) if sizes.device == "cpu" else 256,
            max_num_batched_tokens=sizes.max_num_batched_tokens,
            block_size=sizes.block_size,
            enforce_eager=eager,
        ),
    )
    engine = llm.llm_engine
    rec.put(
        engine_start_s=sig(time.perf_counter() - t0),
        num_gpu_blocks=engine.cache_engine.num_gpu_blocks,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        **graph_stats(engine),
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outputs]
    batch = [{"prompt_token_ids": p} for p in prompts]
    sync(sizes.device)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    sync(sizes.device)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), (produced, sum(outputs))
    rec.put(
        pagedllm_seconds=sig(seconds),
        pagedllm_output_tok_s=sig(produced / seconds),
        pagedllm_total_tok_s=sig((produced + sum(map(len, prompts))) / seconds),
    )


def stage_hf_generate(sizes: Sizes, rec: Record, work: Path) -> None:
    """transformers `generate` on the first hf_seqs prompts of the same workload (left-padded,
    sampled like pagedllm's, each made to produce hf_new_tokens): its rate counts every
    generated token. A stage of its own: the engine's cache is gone, and its failure costs
    pagedllm's figure nothing."""
    import torch

    folder = make_checkpoint(sizes, work / checkpoint_name(sizes))
    prompts, _ = nanovllm_workload(sizes)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, sizes.dtype))
    model = model.to(sizes.device).eval()
    model.generation_config.eos_token_id = None
    hf_prompts = prompts[: sizes.hf_seqs]
    width = max(map(len, hf_prompts))
    ids = torch.zeros(len(hf_prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(hf_prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    ids, mask = ids.to(sizes.device), mask.to(sizes.device)

    def hf_generate(new_tokens: int):
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=0.6,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )

    hf_generate(2)  # warm-up
    sync(sizes.device)
    t0 = time.perf_counter()
    out = hf_generate(sizes.hf_new_tokens)
    sync(sizes.device)
    seconds = time.perf_counter() - t0
    generated = (out.shape[1] - width) * out.shape[0]
    rec.put(
        hf_seqs=len(hf_prompts),
        hf_new_tokens=sizes.hf_new_tokens,
        hf_seconds=sig(seconds),
        hf_output_tok_s=sig(generated / seconds),
    )


def start_engine(rec: Record, build):
    """`build(enforce_eager)`, with CUDA graphs; should their capture fail, the error is recorded
    and the engine built eagerly, so that the stage still gives its eager figures."""
    try:
        return build(False)
    except Exception as e:  # any failure: its traceback goes to the log
        traceback.print_exc()
        rec.put(graph_start_error=repr(e)[:500])
    # outside the handler: the failed engine's memory goes with the exception
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return build(True)


def graph_stats(engine) -> dict:
    """The engine's CUDA-graph capture figures (empty when it captured none)."""
    graphs = getattr(engine.runner, "cuda_graphs", None)
    if graphs is None:
        return {"cuda_graphs": False}
    return {"cuda_graphs": True, **graphs.stats()}


def decode_step_inputs(sizes: Sizes, engine, seed: int = 0):
    """A decode-only step of `batch` sequences at `context` tokens each (this step's included),
    their blocks drawn at random from the cache, as `ModelRunner.prepare` returns it."""
    import torch

    from pagedllm.attention.paged import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    device, b, ctx, page = sizes.device, sizes.batch, sizes.context, sizes.block_size
    per_seq = -(-ctx // page)
    blocks = torch.randperm(engine.cache_engine.num_gpu_blocks, generator=g)[: b * per_seq]
    tables = blocks.view(b, per_seq).to(torch.int32)
    last = ctx - 1
    slots = tables[:, last // page].long() * page + last % page
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=1,
        max_seq_len=ctx,
        is_decode_only=True,
    )
    ids = torch.randint(0, sizes.token_id_max, (b,), generator=g).to(device)
    positions = torch.full((b,), last, dtype=torch.long, device=device)
    return ids, positions, meta, torch.arange(b, device=device)


def stage_decode_step(sizes: Sizes, rec: Record, work: Path, copy_bw: float | None) -> None:
    import torch

    from pagedllm import EngineArgs, LLMEngine

    folder = make_checkpoint(sizes, work / checkpoint_name(sizes))
    page = sizes.block_size
    max_model_len = sizes.context + page
    engine = start_engine(
        rec,
        lambda eager: LLMEngine.from_engine_args(
            EngineArgs(
                model=str(folder),
                dtype=sizes.dtype,
                device=sizes.device,
                skip_tokenizer_init=True,
                block_size=page,
                max_num_seqs=sizes.batch,
                max_model_len=max_model_len,
                num_gpu_blocks=sizes.batch * (-(-max_model_len // page)),
                enforce_eager=eager,
            )
        ),
    )
    rec.put(**graph_stats(engine))
    runner = engine.runner
    with torch.no_grad():  # random cache contents: zeros would hide nothing but are unlike data
        engine.cache_engine.kv_cache.normal_()
    inputs = decode_step_inputs(sizes, engine)
    cfg = engine.model_config
    elem = engine.cache_engine.kv_cache.element_size()
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
    weight_bytes = sum(weights.values())  # tied embeddings counted once, as they are read once
    kv_bytes = (
        sizes.batch * sizes.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    )
    rec.put(weight_bytes=weight_bytes, kv_read_bytes=kv_bytes)
    if copy_bw is None:
        copy_bw = copy_bandwidth(sizes)["copy_bw_GBps"]
    floor = (weight_bytes + kv_bytes) / (copy_bw * 1e9)
    rec.put(copy_bw_GBps=sig(copy_bw), floor_ms=sig(floor * 1e3))

    def step():
        runner.forward(inputs)

    graphs = getattr(runner, "cuda_graphs", None)
    if graphs is not None:
        graphed = median_seconds(step, sizes.device, sizes.reps)
        logits_graph = runner.forward(inputs)
        rec.put(graph_ms=sig(graphed * 1e3), graph_over_floor=sig(graphed / floor))
        runner.cuda_graphs = None
    eager = median_seconds(step, sizes.device, sizes.reps)
    rec.put(eager_ms=sig(eager * 1e3), eager_over_floor=sig(eager / floor))
    if graphs is not None:
        logits_eager = runner.forward(inputs)
        runner.cuda_graphs = graphs
        same = bool(torch.equal(logits_graph.argmax(-1), logits_eager.argmax(-1)))
        diff = (logits_graph - logits_eager).abs().max().item()
        rec.put(graph_argmax_equals_eager=same, graph_max_abs_diff=diff)


def stage_attention(sizes: Sizes, rec: Record, work: Path) -> None:
    import torch

    from pagedllm.kernels.decode_attention import choose_num_splits, paged_decode_attention

    cfg = sizes.model
    b, ctx, page = sizes.batch, sizes.context, sizes.block_size
    heads, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    dtype, device = getattr(torch, sizes.dtype), sizes.device
    per_seq = -(-ctx // page)
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(b * per_seq, generator=g).view(b, per_seq).to(torch.int32).to(device)
    k_cache = torch.randn(b * per_seq, page, kvh, d, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b, heads, d, dtype=dtype, device=device)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    splits = choose_num_splits(b, kvh, ctx + page, device)
    scale = d**-0.5
    rec.put(batch=b, context=ctx, heads=heads, kv_heads=kvh, head_dim=d, num_splits=splits)

    def attend():
        return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, splits)

    # two sequences against the torch reference first: a fast wrong kernel proves nothing
    from pagedllm.kernels import reference as ref

    out = attend()
    expected = ref.paged_decode_attention(
        q[:2].float(), k_cache.float(), v_cache.float(), tables[:2], seq_lens[:2], scale
    )
    err = ((out[:2].float() - expected).norm() / expected.norm()).item()
    rec.put(rel_error=err)
    seconds = median_seconds(attend, device, sizes.reps)
    kv_bytes = 2 * b * ctx * kvh * d * k_cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size()  # q read, output written
    nbytes = kv_bytes + io_bytes
    rec.put(
        kernel_ms=sig(seconds * 1e3),
        kernel_bytes=nbytes,
        kernel_GBps=sig(nbytes / seconds / 1e9),
    )
    # a copy of the same bytes: reads nbytes and writes nbytes
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, sizes.reps)
    copy_bw = 2 * nbytes / copy_s / 1e9
    rec.put(
        copy_ms=sig(copy_s * 1e3),
        copy_GBps=sig(copy_bw),
        kernel_over_copy_bw=sig(nbytes / seconds / 1e9 / copy_bw),
    )


# --- the orchestrator -----------------------------------------------------------------------


def run_bounded(cmd: list[str], seconds: float, **kwargs) -> int:
    """Runs `cmd` in its own process group, output to ours; past `seconds` the whole group is
    killed (a hung kernel or a stuck pytest worker must not outlive its stage). Returns the exit
    code, 124 on timeout."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


def run_stage(name: str, args) -> None:
    """Child process: one stage, its figures to `args.stage_json`."""
    sizes = DRY_RUN if args.dry_run else DEVICE
    if args.tests:
        sizes = dataclasses.replace(sizes, tests=tuple(args.tests.split(",")), serial_tests=())
    rec = Record(Path(args.stage_json))
    work, out = Path(args.work), Path(args.out)
    deadline = time.monotonic() + args.budget
    if name == "env":
        stage_env(sizes, rec, work)
    elif name == "tests":
        stage_tests(sizes, rec, work, out, deadline)
    elif name == "throughput":
        stage_throughput(sizes, rec, work)
    elif name == "hf_generate":
        stage_hf_generate(sizes, rec, work)
    elif name == "decode_step":
        stage_decode_step(sizes, rec, work, args.copy_bw)
    elif name == "attention":
        stage_attention(sizes, rec, work)
    else:
        raise ValueError(f"unknown stage {name!r}; expected one of {STAGES}")


def read_figures(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # never lose the stages after this one over it
        return {"figures_unreadable": str(e)}


def orchestrate(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",") if args.stages else list(STAGES)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"unknown stage(s) {unknown}; expected some of {list(STAGES)}")
    result = {
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "stages": {},
    }
    summary = out / "gpu_check.json"
    log_path = out / "gpu_check.log"
    started = time.monotonic()
    copy_bw = None
    with open(log_path, "a") as log_file:
        for name in stages:
            budget = BUDGETS[name][1 if args.dry_run else 0] * args.budget_scale
            stage_json = work / f"{name}.json"
            stage_json.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--stage",
                name,
                "--stage-json",
                str(stage_json),
                "--out",
                str(out),
                "--work",
                str(work),
                "--budget",
                str(budget),
            ]
            if args.dry_run:
                cmd.append("--dry-run")
            if copy_bw is not None:
                cmd += ["--copy-bw", str(copy_bw)]
            if args.tests:
                cmd += ["--tests", args.tests]
            header = f"=== stage {name} (budget {budget:.0f} s)"
            print(header, flush=True)
            log_file.write(header + "\n")
            log_file.flush()
            t0 = time.monotonic()
            # the stage's output goes to the log; the tests stage's pytest summary too
            code = run_bounded(cmd, budget, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)
            seconds = time.monotonic() - t0
            figures = read_figures(stage_json)
            status = "ok" if code == 0 else ("timeout" if code == 124 else "failed")
            result["stages"][name] = {
                "status": status,
                "exit": code,
                "seconds": sig(seconds),
                **figures,
            }
            if name == "env" and "copy_bw_GBps" in figures:
                copy_bw = figures["copy_bw_GBps"]
            print(f"    {status} in {seconds:.1f} s", flush=True)
            result["total_seconds"] = sig(time.monotonic() - started)
            summary.write_text(json.dumps(result, indent=1, default=str))
    print_summary(result, log_path)
    write_markdown(result, out / "gpu_check.md")
    return 0 if all(s["status"] == "ok" for s in result["stages"].values()) else 1


# the figures the summary table shows, per stage (the JSON has them all)
HEADLINE = {
    "env": ("device_name", "copy_bw_GBps"),
    "tests": ("passed", "failures", "errors", "skipped"),
    "throughput": ("pagedllm_output_tok_s", "cuda_graphs", "capture_s", "engine_start_s"),
    "hf_generate": ("hf_output_tok_s", "hf_seqs", "hf_new_tokens"),
    "decode_step": ("floor_ms", "graph_ms", "eager_ms", "graph_over_floor", "eager_over_floor"),
    "attention": ("kernel_GBps", "copy_GBps", "kernel_over_copy_bw", "rel_error"),
}


def write_markdown(result: dict, path: Path) -> None:
    """The figures as a table to paste into benches/RESULTS.md (the device name included)."""
    device = result["stages"].get("env", {}).get("device_name", "?")
    lines = [
        f"Device: {device}; run {result['started']} UTC, {result['total_seconds']} s in all"
        + (" (dry run: CPU, interpreter, tiny sizes; not figures)" if result["dry_run"] else ""),
        "",
        "| stage | status | s | figures |",
        "| --- | --- | --- | --- |",
    ]
    for name, stage in result["stages"].items():
        figures = ", ".join(
            f"{k}={v}"
            for k, v in stage.items()
            if k not in ("status", "exit", "seconds") and not isinstance(v, (list, dict))
        )
        lines.append(f"| {name} | {stage['status']} | {stage['seconds']} | {figures} |")
    path.write_text("\n".join(lines) + "\n")


def print_summary(result: dict, log_path: Path) -> None:
    # a failed stage's last lines first, then the table last (the device reply shows the tail)
    lines = log_path.read_text(errors="replace").splitlines()
    for name, stage in result["stages"].items():
        if stage["status"] != "ok":
            marker = f"=== stage {name} "
            start = max(i for i, line in enumerate(lines) if line.startswith(marker))
            end = next(
                (i for i in range(start + 1, len(lines)) if lines[i].startswith("=== stage ")),
                len(lines),
            )
            print(f"--- {name} ({stage['status']}), last lines:")
            print("\n".join(lines[max(start + 1, end - 15) : end]))
    print(f"{'stage':<12} {'status':<8} {'s':>6}  figures")
    for name, stage in result["stages"].items():
        shown = ", ".join(f"{k}={stage[k]}" for k in HEADLINE[name] if k in stage)
        print(f"{name:<12} {stage['status']:<8} {stage['seconds']:>6}  {shown}")
    print(f"total {result['total_seconds']} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json/.log, tests.xml")
    parser.add_argument("--work", default=None, help="scratch folder (checkpoint); default OUT/../")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--stages", default=None, help=f"comma-separated subset of {STAGES}")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every budget")
    parser.add_argument(
        "--tests",
        default=None,
        help="comma-separated pytest paths/ids for the tests stage, instead of its list (a rerun "
        "of what failed); no serial run then",
    )
    # internal: one stage in a child process
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stage-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--copy-bw", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.work is None:
        args.work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "pagedllm_gpu_check")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the stages, set before triton loads
    if args.stage is None:
        return orchestrate(args)
    log(f"stage {args.stage} ({'dry run' if args.dry_run else 'device'})")
    try:
        run_stage(args.stage, args)
    except Exception:
        traceback.print_exc()
        return 1
    log(f"stage {args.stage} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
