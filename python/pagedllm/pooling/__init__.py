"""Pooling models (vLLM's `runner="pooling"`): prefill-only requests on the generating engine's
scheduler whose result is a pooled hidden state — an embedding (last-token, mean or CLS
pooling, normalized as the checkpoint's sentence-transformers modules say) or a classification
head's scores (`*ForSequenceClassification`: the sigmoid of a single logit, as vLLM gives it;
or a causal LM's two-token log-odds under `hf_overrides`, Qwen3-Reranker's recipe).

- `config.py`: what the checkpoint says about pooling (`PoolerConfig`).
- `pooler.py`: the math, per chunk of a prompt and at its end.
- `engine.py`: `PoolingEngine` (the step loop's pooling variant) and `build_engine`.
- `token_classifier.py`: the one-label head a causal LM's lm_head rows make (`hf_overrides`).
- `score_template.py`: a (query, document) pair rendered by a score template (`chat_template`).
- `offline.py`: what `LLM.embed` / `LLM.score` run (the serve flags: `cli/flags.py`).
"""

from pagedllm.pooling.config import PoolerConfig, read_pooler_config
from pagedllm.pooling.engine import PoolingEngine, build_engine
from pagedllm.pooling.params import PoolingParams

__all__ = ["PoolerConfig", "PoolingEngine", "PoolingParams", "build_engine", "read_pooler_config"]
