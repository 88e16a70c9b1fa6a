"""`PoolingEngine`: the step loop for pooling models, on the same Rust scheduler.

A pooling request is a prefill-only request: it enters the scheduler as a prompt that may make
one token, and its prefill's last chunk ends it — no decode, no sampling. Each step the runner
hands back the final hidden states of every row (`ModelRunner.forward_hidden`); the pooler
takes what each request needs:

- last-token pooling (and every classification head): the last prompt row, from the step that
  completes the prefill. Nothing else of the prompt is read, so requests share the prefix cache
  like generating ones (a fixed instruction before every query is computed once).
- mean and CLS pooling: every position. Prefill chunks accumulate (`ChunkSums`), so chunked
  prefill stays on; the prefix cache is turned off for such a model (a hit would skip positions
  that the mean needs), as in vLLM.

The scheduler is then told the request's one "token" (id 0, never shown) so that it finishes it
the usual way (finish reason "length"); the request's `PoolingRequestOutput.pooled` carries the
result.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.engine.output_processor import AppendedStep
from pagedllm.lora.request import LoRARequest
from pagedllm.models import load_model_config
from pagedllm.models.sequence_classification import check_generating, pooling_task
from pagedllm.pooling.config import PoolerConfig, read_pooler_config
from pagedllm.pooling.outputs import PoolingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import ChunkSums, class_scores, finish_embedding
from pagedllm.pooling.token_classifier import token_classifier, token_classifier_head, token_ids
from pagedllm.sampling_params import SamplingParams

# what the scheduler runs a pooling request as: its prompt, then one token it never computes
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


def build_engine(args: EngineArgs) -> LLMEngine:
    """The engine `args.runner` asks for: a `PoolingEngine`, or the generating `LLMEngine`
    (which refuses a classification checkpoint, naming `runner`)."""
    if args.runner == "pooling":
        return PoolingEngine(args)
    check_generating(load_model_config(args.model))
    return LLMEngine(args)


class PoolingEngine(LLMEngine):
    """`LLMEngine` whose requests end after their prefill with a pooled result (see the module
    docstring). `add_request` takes `PoolingParams` instead of `SamplingParams`."""

    def __init__(self, args: EngineArgs) -> None:
        cfg = load_model_config(args.model)
        # a causal LM made a reranker by hf_overrides: classify with a head built from lm_head
        # rows once the model is loaded (as a causal LM: `convert` reset for the loader)
        self.token_classifier = token_classifier(cfg, args.hf_overrides)
        task = pooling_task(cfg, args.convert)
        if self.token_classifier is not None:
            task, args = "classify", dataclasses.replace(args, convert="auto")
        self.pooler_config: PoolerConfig = read_pooler_config(cfg, task)
        if self.pooler_config.uses_every_position and args.enable_prefix_caching:
            args = dataclasses.replace(args, enable_prefix_caching=False)
        self.chunks = ChunkSums(self.pooler_config.pooling_type)
        self._params: dict[str, PoolingParams] = {}
        self._pooled: dict[str, torch.Tensor] = {}
        self._rows = None  # the step (or quarantined group) whose forward runs next
        super().__init__(args)
        if self.token_classifier is not None:
            ids = token_ids(self.tokenizer, self.token_classifier)
            self.model.score = token_classifier_head(cfg, self.model, ids)

    @property
    def task(self) -> str:
        return self.pooler_config.task

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a pooling request; bad input raises ValueError naming the field."""
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(
                f"request {request_id!r}: a pooling model takes PoolingParams, got "
                f"{type(params).__name__} (this engine runs runner='pooling': it does not "
                "generate)"
            )
        params.check(self.pooler_config, self.model_config.hidden_size)
        text, token_ids = self.inputs.tokenize(request_id, prompt)
        if hasattr(token_ids, "__len__") and len(token_ids) > self.max_model_len:
            # a generating request would finish at once with "length": a pooled one has nothing
            raise ValueError(
                f"request {request_id!r}: the input has {len(token_ids)} tokens; max_model_len "
                f"is {self.max_model_len}"
            )
        prompt = {"prompt_token_ids": token_ids, "prompt": text}
        super().add_request(request_id, prompt, PREFILL_ONLY, arrival_time, priority, lora_request)
        self._params[request_id] = params

    # ---- the step's hooks -------------------------------------------------------------------

    def _prepare(self, step, groups):
        self._rows = step
        return super()._prepare(step, groups)

    def _forward(self, inputs, prompt=None) -> torch.Tensor | None:
        return self._pool(self._rows, inputs)

    def _forward_rows(self, rows) -> torch.Tensor | None:
        return self._pool(rows, self.runner.prepare(rows))

    def _pool(self, rows, inputs) -> torch.Tensor | None:
        """Runs the forward of `rows` (a step or a group of its rows); returns, per request
        whose prefill completes, its pooled state (embed) or class scores (classify)."""
        hidden = self.runner.forward_hidden(inputs)
        starts = rows.query_start_loc
        if self.pooler_config.uses_every_position:
            positions = rows.positions
            for i, request_id in enumerate(rows.request_ids):
                first, end = int(starts[i]), int(starts[i + 1])
                self.chunks.add(request_id, int(positions[first]), hidden[first:end])
        last_rows = inputs[3]
        if last_rows.numel() == 0:
            return None
        if self.task == "classify":
            with torch.inference_mode():
                return class_scores(self.model.score(hidden.index_select(0, last_rows)))
        if not self.pooler_config.uses_every_position:
            return hidden.index_select(0, last_rows).float()
        return torch.stack([self.chunks.pop(rows.request_ids[s]) for s in rows.sample_rows])

    def _sample(self, step, logits, rows=None, *, grammar=None):
        # nothing is sampled: the pooled results pass through to `_update`
        return logits if rows is None else logits[rows]

    def _update(self, step, sampled, touched, grammar=None) -> int:
        """Keeps each finished prefill's result and has the scheduler finish its request."""
        request_ids = step.sample_request_ids
        for k, request_id in enumerate(request_ids):
            result = sampled[k]
            if self.task == "embed":
                dims = self._params[request_id].dimensions
                result = finish_embedding(self.pooler_config, result, dims)
            self._pooled[request_id] = result.cpu()
            touched[request_id] = self.requests[request_id]
        tokens = np.zeros(len(request_ids), dtype=np.int64)
        appended = AppendedStep(tokens, np.zeros(len(tokens), dtype=bool))
        finished = self.scheduler.update_from_output(step, tokens, appended.stop_hits)
        self.output_processor.finish(finished, appended, touched)
        return 0

    def _outputs(self, touched) -> list[PoolingRequestOutput]:
        outputs = []
        for output in super()._outputs(touched):
            pooled = None
            if output.finished:
                pooled = self._pooled.pop(output.request_id, None)
                self._params.pop(output.request_id, None)
                self.chunks.forget(output.request_id)
            outputs.append(PoolingRequestOutput(**vars(output), pooled=pooled))
        return outputs
