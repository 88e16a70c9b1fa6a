"""Structured output's cost per decode step, and how often sampled outputs are valid JSON.

1. Overhead: the same batch (8 and 64 requests) decoding with and without a JSON-schema
   constraint, on the built-in model (a byte vocabulary of 259 tokens) and on a tiny checkpoint
   with a 32k-token byte-level BPE vocabulary (the mask's cost grows with the vocabulary). The
   schema is an array of at least 100 objects (a boolean, an enum, a bounded string), so no
   output completes, EOS is never allowed, and both runs decode exactly `OUTPUT_LEN` tokens per
   request. Reported per decode step: wall time free vs constrained (median of `ROUNDS`,
   interleaved), the bitmask fill's own time on its thread (overlapped with the forward), and
   how long sampling still waited for it.
2. Validity: `N_VALID` seeded samples at temperature 1 under a schema with a free string field
   (any content, at most 32 characters so every sample completes), on the byte vocabulary
   (every control byte is one token away): how many parse and validate.
3. Speculation under the grammar: `SPEC_BATCH` requests under the endless array schema, greedy
   and at temperature 1 (seeded), with and without n-gram speculation (k = 4) on the built-in
   model; the prompt shows a few items, so the items the model writes recur. Reported: tokens/s
   (median of `ROUNDS`, the cases interleaved), target forwards (engine steps) per output token
   of one request alone, acceptance (accepted / verified drafts), how many of the drafts
   proposed for constrained sequences the grammar kept, and the bitmask fill per step (its
   rows: d + 1 per constrained sample) on its thread. Greedy outputs must be identical.

Run: python benches/test_bench_structured_output.py  (prints the tables of benches/RESULTS.md;
  `... speculation` runs part 3 only)
  or python -m pytest benches/test_bench_structured_output.py -s
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

BATCHES, OUTPUT_LEN, ROUNDS, N_VALID, BPE_VOCAB = (8, 64), 48, 3, 48, 32000
ITEM = {
    "type": "object",
    "properties": {
        "done": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 12},
    },
    "required": ["done", "color", "name"],
    "additionalProperties": False,
}
ENDLESS = {"type": "array", "items": ITEM, "minItems": 100}
FREE_STRING = {
    "type": "object",
    # free content (no pattern), bounded so that every sample completes within max_tokens
    "properties": {"name": {"type": "string", "maxLength": 32}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def bpe_checkpoint(folder: Path) -> Path:
    """A tiny Llama with a `BPE_VOCAB`-token byte-level BPE trained on local Python sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    sources = sorted(Path(json.__file__).parent.parent.rglob("*.py"))[:1500]
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in sources)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def overhead(llm: LLM, label: str, out) -> None:
    so = StructuredOutputsParams(json=ENDLESS)
    manager = llm.engine.structured_output
    for batch in BATCHES:
        prompts = [f"item {i}:" for i in range(batch)]
        free = SamplingParams(temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True, seed=1)
        bound = SamplingParams(
            temperature=1.0, max_tokens=OUTPUT_LEN, ignore_eos=True, seed=1, structured_outputs=so
        )
        times = {"free": [], "constrained": []}
        fill, wait, steps = 0.0, 0.0, 0
        for r in range(ROUNDS + 1):  # the first round warms up (and compiles the schema)
            for name, params in (("free", free), ("constrained", bound)):
                stats = manager.stats
                before = (stats.fill_s, stats.wait_s, stats.steps)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
                assert all(len(o.outputs[0].token_ids) == OUTPUT_LEN for o in outs)
                if name == "constrained" and r:
                    fill += stats.fill_s - before[0]
                    wait += stats.wait_s - before[1]
                    steps += stats.steps - before[2]
        free_ms, bound_ms = (statistics.median(times[n][1:]) / OUTPUT_LEN * 1e3 for n in times)
        print(
            f"| {label} | {batch} | {free_ms:.2f} | {bound_ms:.2f} | "
            f"{bound_ms - free_ms:+.2f} ({bound_ms / free_ms - 1:+.0%}) | "
            f"{fill / steps * 1e3:.2f} | {isolated_fill_ms(manager, so, batch):.2f} | "
            f"{wait / steps * 1e3:.3f} |",
            file=out,
        )


def isolated_fill_ms(manager, so: StructuredOutputsParams, batch: int, reps: int = 50) -> float:
    """One bitmask fill for `batch` matchers inside a JSON string, nothing else running (on
    the calling thread; includes allocating the [batch, W] int32 mask)."""
    template = manager.compile(so).result()
    prefix = manager._vocabulary().tokenize_str('[{"done": true, "color": "red", "name": "a')
    matchers = [template.deep_copy() for _ in range(batch)]
    for m in matchers:
        assert m.consume_tokens(prefix)
    manager.fill_now(matchers)
    t0 = time.perf_counter()
    for _ in range(reps):
        manager.fill_now(matchers)
    return (time.perf_counter() - t0) / reps * 1e3


def isolated_draft_fill_ms(manager, so, batch: int, k: int, reps: int = 50) -> float:
    """`isolated_fill_ms` with `k` drafts per matcher: `batch * (k + 1)` rows, each matcher's
    mask after every prefix of its drafts (llguidance consumes and rolls them back)."""
    template = manager.compile(so).result()
    vocab = manager._vocabulary()
    prefix = vocab.tokenize_str('[{"done": true, "color": "red", "name": "a')
    drafts = vocab.tokenize_str("bcdefghij")[:k]
    matchers = [template.deep_copy() for _ in range(batch)]
    for m in matchers:
        assert m.consume_tokens(prefix) and m.validate_tokens(drafts) == k
    runs = [drafts] * batch
    bits = manager._bitmask(batch * (k + 1))
    manager._fill_drafts(matchers, runs, bits)
    t0 = time.perf_counter()
    for _ in range(reps):
        manager._fill_drafts(matchers, runs, manager._bitmask(batch * (k + 1)))
    return (time.perf_counter() - t0) / reps * 1e3


def validity(llm: LLM, out) -> int:
    so = StructuredOutputsParams(json=FREE_STRING)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=so)
        for s in range(N_VALID)
    ]
    outs = llm.generate([f"record {s}:" for s in range(N_VALID)], params, use_tqdm=False)
    valid = escaped = raw = 0
    for o in outs:
        text = o.outputs[0].text
        raw += any(ord(c) < 0x20 for c in text)
        try:
            jsonschema.validate(json.loads(text), FREE_STRING)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            continue
        valid += 1
        escaped += "\\u00" in text or any(f"\\{c}" in text for c in "tnrbf")
    stops = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    print(
        f"valid JSON (parsed and schema-valid): {valid} of {N_VALID}; finished with stop: "
        f"{stops}; outputs holding escaped control characters: {escaped}, raw ones: {raw}",
        file=out,
    )
    return valid


SPEC_BATCH, SPEC_LEN = 8, 128
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
ITEMS_PROMPT = (
    '[{"done": true, "color": "red", "name": "a"}, {"done": false, "color": "blue", '
    '"name": "bc"}, {"done": true, "color": "green", "name": "d"}] '
)


def speculation(out) -> None:
    so = StructuredOutputsParams(json=ENDLESS)
    engines = {
        name: LLM(device="cpu", max_model_len=512, seed=0, cpu_threads=1, speculative_config=spec)
        for name, spec in (("constrained", None), ("constrained + ngram", NGRAM))
    }
    print(
        "| sampling | case | tokens/s (batch 8) | forwards per token (alone) | acceptance | "
        "constrained drafts kept by the grammar | mask rows per step | fill ms/step | "
        "sampling waited ms/step |",
        file=out,
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", file=out)
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=1, max_tokens=SPEC_LEN, ignore_eos=True,
            structured_outputs=so,
        )  # fmt: skip
        prompts = [f"{ITEMS_PROMPT}{i}:" for i in range(SPEC_BATCH)]
        times = {name: [] for name in engines}
        results, row = {}, {}
        for name, llm in engines.items():
            engine = llm.llm_engine
            before = engine.get_stats()["num_steps"]
            llm.generate(prompts[:1], params, use_tqdm=False)
            row[name] = (engine.get_stats()["num_steps"] - before) / SPEC_LEN
        start = {name: dict(llm.llm_engine.get_stats()) for name, llm in engines.items()}
        fills = {n: llm.llm_engine.structured_output.stats for n, llm in engines.items()}
        fill_start = {n: (f.steps, f.rows, f.fill_s, f.wait_s) for n, f in fills.items()}
        cuts = engines["constrained + ngram"].llm_engine.structured_output.draft_cuts
        cut_start = (cuts.proposed, cuts.kept)
        for r in range(ROUNDS + 1):  # the first round warms up
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if r:
                    times[name].append(time.perf_counter() - t0)
                results[name] = [o.outputs[0].token_ids for o in outs]
                assert all(len(t) == SPEC_LEN for t in results[name])
        if temperature == 0.0:
            assert results["constrained"] == results["constrained + ngram"]
        for name, llm in engines.items():
            stats, was = llm.llm_engine.get_stats(), start[name]
            drafts = stats["spec_decode_num_draft_tokens"] - was["spec_decode_num_draft_tokens"]
            accepted = (
                stats["spec_decode_num_accepted_tokens"] - was["spec_decode_num_accepted_tokens"]
            )
            rate = f"{accepted / drafts:.2f}" if drafts else "—"
            kept = "—"
            if name != "constrained":
                proposed = cuts.proposed - cut_start[0]
                kept = f"{cuts.kept - cut_start[1]} of {proposed}"
            tps = SPEC_BATCH * SPEC_LEN / statistics.median(times[name])
            f, (steps, rows, fill_s, wait_s) = fills[name], fill_start[name]
            steps = f.steps - steps
            print(
                f"| T={temperature:g} | {name} | {tps:.0f} | {row[name]:.2f} | {rate} | {kept} | "
                f"{(f.rows - rows) / steps:.1f} | {(f.fill_s - fill_s) / steps * 1e3:.3f} | "
                f"{(f.wait_s - wait_s) / steps * 1e3:.3f} |",
                file=out,
            )
    manager = engines["constrained + ngram"].llm_engine.structured_output
    for batch in (8, 64):
        plain = isolated_fill_ms(manager, so, batch)
        drafted = isolated_draft_fill_ms(manager, so, batch, NGRAM["num_speculative_tokens"])
        print(
            f"fill alone, batch {batch}: {plain:.3f} ms for {batch} rows, with 4 drafts each "
            f"{drafted:.3f} ms for {batch * 5} rows",
            file=out,
        )


def run(out=sys.stdout) -> int:
    byte_llm = LLM(device="cpu", max_model_len=256, max_num_seqs=64, seed=0)
    print(
        "| vocabulary | batch | free ms/step | constrained ms/step | overhead |", end="", file=out
    )
    print(
        " fill ms/step (its thread, in the run) | fill ms alone | sampling waited ms/step |",
        file=out,
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", file=out)
    overhead(byte_llm, "bytes (259)", out)
    folder = bpe_checkpoint(Path(tempfile.mkdtemp(prefix="pagedllm-so-bench-")))
    bpe_llm = LLM(str(folder), device="cpu", max_model_len=256, max_num_seqs=64, seed=0)
    overhead(bpe_llm, f"byte-level BPE ({BPE_VOCAB // 1000}k)", out)
    return validity(byte_llm, out)


def test_bench_structured_output():
    assert run() == N_VALID


def test_bench_structured_output_speculation():
    speculation(sys.stdout)


if __name__ == "__main__":
    torch.set_num_threads(1)  # see RESULTS.md: a shared 2-core machine
    if sys.argv[1:] == ["speculation"]:
        speculation(sys.stdout)
    else:
        run()
        speculation(sys.stdout)
