"""Structured output: requests whose output must follow a JSON schema, a regex, a list of
choices or a grammar, through llguidance (a maintained grammar engine; vLLM ships it).

- `params`: `StructuredOutputsParams`, the constraint of one request (pure Python);
- `vocab`: the engine's tokenizer handed to llguidance once (`LLTokenizer`);
- `compiler`: a constraint to a compiled matcher, with errors naming the problem;
- `manager`: `StructuredOutputManager`, the engine's side: compiles off the engine thread
  (a small pool, cached by (kind, spec)), one matcher per sequence, the step's token bitmask
  filled in parallel while the forward runs, and each matcher advanced by its sampled token.

The scheduler holds a request whose grammar compiles in `waiting` without blocking others
(`Scheduler.grammar_ready`), and names the constrained samples of each step
(`SchedulerOutput.structured_output_samples`); the sampler masks their logits first
(`pagedllm.sampling.grammar_mask`).
"""

from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
