"""The command line's pooling flags (vLLM's names): `--runner pooling` serves the model's
pooled hidden states (/v1/embeddings, /v1/score, /v1/rerank) instead of generating, and
`--convert embed|classify` says how a causal LM checkpoint is pooled. `pagedllm serve` adds them
to its parser (`add_pooling_flags`) and merges `pooling_engine_kwargs` into its engine keywords.
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedllm.config import CONVERTS, RUNNERS, EngineArgs

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def add_pooling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pooling models")
    g.add_argument(
        "--runner",
        choices=RUNNERS,
        default=_DEFAULTS["runner"],
        help="'pooling': prefill-only requests whose result is the pooled hidden state "
        "(embeddings; scores from a *ForSequenceClassification head)",
    )
    g.add_argument(
        "--convert",
        choices=CONVERTS,
        default=_DEFAULTS["convert"],
        help="with --runner pooling: 'embed' pools a causal LM (last token, normalized, unless "
        "its sentence-transformers files say otherwise); 'classify' scores with its "
        "score.weight head; 'auto': by the architecture",
    )


def pooling_engine_kwargs(args: argparse.Namespace) -> dict:
    """The `EngineArgs` keywords of the pooling flags."""
    return {"runner": args.runner, "convert": args.convert}
