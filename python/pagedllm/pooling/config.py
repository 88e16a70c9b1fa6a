"""`PoolerConfig`: how a checkpoint's hidden states become its result, read from the files
sentence-transformers writes beside the weights (vLLM reads the same ones):

- `modules.json`: the module list; `sentence_transformers.models.Pooling` names a folder whose
  `config.json` holds the pooling mode (`pooling_mode_lasttoken`, `_mean_tokens`,
  `_cls_token`), and a `sentence_transformers.models.Normalize` entry makes the embedding unit
  length. `Transformer` is the model itself. Any other module (Dense, ...) is refused by name.
- without `modules.json`: last-token pooling, normalized (Qwen3-Embedding's recipe, what vLLM
  does for a causal LM run to embed).
- `config.json`'s `is_matryoshka` / `matryoshka_dimensions`: whether a request may ask for fewer
  `dimensions` (and which).

A classification head (task "classify") always reads the last token, as transformers'
`*ForSequenceClassification` does, and is never normalized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedllm.checkpoint.errors import CheckpointError
from pagedllm.models.config import ModelConfig, read_json

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_MODULE_PREFIX = "sentence_transformers.models."
# sentence-transformers' Pooling config field -> our pooling type
_POOLING_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolerConfig:
    """`task`: "embed" or "classify"; `pooling_type`: one of POOLING_TYPES; `normalize`: unit
    length embeddings; `matryoshka`: requests may ask for fewer `dimensions`, any of
    `matryoshka_dimensions` (every size up to the hidden size when None)."""

    task: str = "embed"
    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def uses_every_position(self) -> bool:
        """Mean and CLS pooling read positions before the last: a prefix-cache hit would skip
        them, so such a model runs without prefix caching (as in vLLM)."""
        return self.pooling_type != "LAST"


def read_pooler_config(cfg: ModelConfig, task: str) -> PoolerConfig:
    """The pooler of the checkpoint (`cfg.path`; None: a built-in model, pooled by default)."""
    folder = Path(cfg.path) if cfg.path is not None and Path(cfg.path).is_dir() else None
    matryoshka, dimensions = _matryoshka(folder)
    if task == "classify":
        return PoolerConfig("classify", "LAST", False)
    pooling_type, normalize = "LAST", True
    if folder is not None and (folder / "modules.json").is_file():
        pooling_type, normalize = _read_modules(folder)
    return PoolerConfig(task, pooling_type, normalize, matryoshka, dimensions)


def _read_modules(folder: Path) -> tuple[str, bool]:
    path = folder / "modules.json"
    try:
        import json

        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(modules, list):
        raise CheckpointError(f"{path}: expected a list of modules")
    pooling_type, normalize = "LAST", False
    for i, module in enumerate(modules):
        kind = module.get("type", "") if isinstance(module, dict) else ""
        name = kind.removeprefix(_MODULE_PREFIX)
        if name == "Pooling":
            pooling_type = _pooling_mode(folder / module.get("path", "") / "config.json")
        elif name == "Normalize":
            normalize = True
        elif name != "Transformer":
            raise CheckpointError(
                f"{path}: module [{i}] type {kind!r} is not supported (only Transformer, "
                "Pooling and Normalize)"
            )
    return pooling_type, normalize


def _pooling_mode(path: Path) -> str:
    raw = read_json(path)
    for field in _UNSUPPORTED_MODES:
        if raw.get(field):
            raise CheckpointError(f"{path}: {field} is not supported (last token, mean or CLS)")
    modes = [kind for field, kind in _POOLING_MODES.items() if raw.get(field)]
    if len(modes) != 1:
        raise CheckpointError(
            f"{path}: exactly one of {', '.join(_POOLING_MODES)} must be true, got {modes}"
        )
    return modes[0]


def _matryoshka(folder: Path | None) -> tuple[bool, tuple[int, ...] | None]:
    if folder is None or not (folder / "config.json").is_file():
        return False, None
    raw = read_json(folder / "config.json")
    dimensions = raw.get("matryoshka_dimensions")
    if isinstance(dimensions, list) and dimensions:
        return True, tuple(int(d) for d in dimensions)
    return bool(raw.get("is_matryoshka", False)), None
