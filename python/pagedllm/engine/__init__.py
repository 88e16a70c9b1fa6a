"""The engine: the step loop (`LLMEngine`) and what it owns.

- `llm_engine`: `LLMEngine`, add -> step -> outputs
- `request`: per-request state (sequences, metrics, stop tokens)
- `registry`: `RequestRegistry`, the live requests' one owner (add, abort, finish, release)
- `inputs`: request input checks and prompt tokenization
- `output_processor`: sampled tokens -> sequences, text, stop strings
- `detokenizer`: incremental detokenization with stop strings
- `faults`: rolling back a failed step, ending the request a fault belongs to
- `batch`: one batch of requests run to completion (`LLM.generate`, a replica process)
- `stats`: step timings and throughput counters
- `kv_sizing`: start-up sizing of the KV cache
- `parts`: the optional parts built from the arguments (speculative decoder, offload tier,
  KV-event publisher) and the checks a model passes before loading
"""

from pagedllm.engine.inputs import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import StepTimings

__all__ = ["LLMEngine", "PromptType", "StepTimings"]
