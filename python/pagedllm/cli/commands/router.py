"""`pagedllm router`: an OpenAI-compatible proxy over `pagedllm serve` replicas (and other
engines' servers), routing by their prefix caches (KV events) and load."""

from __future__ import annotations

import argparse
import logging
import os

from pagedllm.cli.flags import (
    ENGINE_DEFAULTS,
    EPILOG,
    POSITIVE,
    listen_flags,
    log_level_flag,
    routing_flags,
)


def add_parser(sub) -> argparse.ArgumentParser:
    """The `router` subcommand's parser."""
    router = sub.add_parser(
        "router",
        help="an OpenAI-compatible proxy routing over `pagedllm serve` replicas by their prefix "
        "caches (KV events) and load",
        epilog=EPILOG,
    )
    router.add_argument(
        "--replica",
        action="append",
        metavar="URL",
        help="a `pagedllm serve` replica's base URL, e.g. http://127.0.0.1:8001 (repeat for "
        "each); its KV events are found through its GET /load",
    )
    router.add_argument(
        "--external-replica",
        action="append",
        nargs="+",
        metavar=("URL", "EVENTS"),
        help="another engine's server (vLLM's, started with --kv-events-config) and its KV-event "
        "endpoint, optionally its replay endpoint: URL EVENTS [REPLAY], e.g. "
        "http://10.0.0.5:8000 tcp://10.0.0.5:5557 (repeat for each); its load is read from its "
        "/metrics, its blocks re-hashed from the token ids its events carry",
    )
    listen_flags(router)
    router.add_argument(
        "--block-size",
        type=POSITIVE,
        default=ENGINE_DEFAULTS["block_size"],
        help="the replicas' KV block size (a replica reporting another is routed by load only)",
    )
    routing_flags(router)
    router.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics, and "
        "send it on the replicas' /load polls (default: PAGEDLLM_API_KEY, else none; an empty "
        "--api-key is refused)",
    )
    log_level_flag(router, help="the router's log level")
    return router


def _external_replicas(given: list[list[str]]) -> list[tuple[str, str, str | None]]:
    """`--external-replica URL EVENTS [REPLAY]` values -> (URL, EVENTS, REPLAY or None)."""
    out = []
    for values in given:
        if len(values) not in (2, 3):
            raise ValueError(
                "--external-replica takes URL EVENTS_ENDPOINT [REPLAY_ENDPOINT], got "
                f"{' '.join(values)!r}"
            )
        out.append((values[0], values[1], values[2] if len(values) == 3 else None))
    return out


def run(args: argparse.Namespace) -> int:
    from pagedllm.router.app import build_router_app, run_router
    from pagedllm.router.replicas import ReplicaSet

    # the balance knobs left out: the router core's defaults
    knobs = {
        name: getattr(args, name)
        for name in (
            "balance_abs_threshold",
            "balance_rel_threshold",
            "token_weight",
            "affinity_weight",
            "unresponsive_after",
        )
        if getattr(args, name) is not None
    }
    # wanted from clients, sent on the replicas' polls (`serve -dp`: the replicas' key too); as
    # `serve`'s: an empty variable is unset, an empty --api-key refused
    api_key = args.api_key
    if api_key is None:
        api_key = os.environ.get("PAGEDLLM_API_KEY") or None
    replicas = ReplicaSet(
        args.replica or [],
        external=_external_replicas(getattr(args, "external_replica", None) or []),
        block_size=args.block_size,
        policy=args.routing_policy,
        health_interval=args.health_interval,
        api_key=api_key,
        **knobs,
    )
    app = build_router_app(replicas, session_header=args.session_header, api_key=api_key)
    logging.getLogger("pagedllm").addHandler(logging.StreamHandler())
    logging.getLogger("pagedllm").setLevel(args.log_level.upper())
    return run_router(app, args.host, args.port, log_level=args.log_level)
