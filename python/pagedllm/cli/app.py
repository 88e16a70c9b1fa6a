"""The `pagedllm` command: `generate`, `bench`, `serve`, `run-batch`, `router` and `export-tiny`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from pagedllm.cli.commands import bench, export_tiny, generate, router, run_batch, serve
from pagedllm.cli.commands.bench import run as _bench
from pagedllm.cli.commands.bench import run_serve as _bench_serve
from pagedllm.cli.commands.export_tiny import run as _export_tiny
from pagedllm.cli.commands.generate import run as _generate
from pagedllm.cli.commands.router import run as _router
from pagedllm.cli.commands.run_batch import run as _run_batch
from pagedllm.cli.commands.serve import loaded_summary as loaded_summary
from pagedllm.cli.commands.serve import run as _serve
from pagedllm.cli.flags import DEBUG_ENV, EPILOG, HelpFormatter
from pagedllm.cli.flags import engine_kwargs as _engine_kwargs  # noqa: F401 - tests reach it here


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), like every other error, and
    names the --help of the (sub)command it is about."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)  # subcommands' parsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse hands a subcommand's unknown arguments up to the top-level parser, whose
        # error would name `pagedllm --help`: each parser refuses its own instead
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser, wired to the function it runs (looked up here, at build time)."""
    parser = _Parser(prog="pagedllm", description=__doc__, epilog=EPILOG)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False,
        help=f"show full Python tracebacks on errors (also: {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    generate.add_parser(sub).set_defaults(func=_generate)
    offline, online = bench.add_parsers(sub)
    offline.set_defaults(func=_bench)
    online.set_defaults(func=_bench_serve)
    serve.add_parser(sub).set_defaults(func=_serve)
    run_batch.add_parser(sub).set_defaults(func=_run_batch)
    router.add_parser(sub).set_defaults(func=_router)
    export_tiny.add_parser(sub).set_defaults(func=_export_tiny)
    return parser


def _debug_requested(args: argparse.Namespace) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no", "off")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the input is wrong" (bad flag, model folder, file), not a bug."""
    from pagedllm import PagedLLMError

    return (ValueError, TypeError, LookupError, OSError, PagedLLMError)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _debug_requested(args):
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("pagedllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `pagedllm generate ... | head -1`: stop quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - the CLI reports, --debug shows the traceback
        message = _one_line(str(exc)) or type(exc).__name__
        if not isinstance(exc, _user_errors()):
            message = (
                f"{type(exc).__name__}: {message} (an unexpected error: rerun with --debug "
                f"or {DEBUG_ENV}=1 for the traceback)"
            )
        print(f"pagedllm: error: {message}", file=sys.stderr)
        return 1
