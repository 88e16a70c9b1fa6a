"""The `pagedllm` command line: `generate`, `bench`, `serve`, `router` and `export-tiny`.

- `app`: the top-level parser wiring each subcommand to what it runs, and the one-line error
  reporting (`main`)
- `commands/`: one module per subcommand, its parser and its `run`
- `flags`: the flags several subcommands share (engine, sampling, routing, server address, log
  level), each default in one place
- `bench`: the offline throughput benchmark behind `pagedllm bench` (`bench_serve`: against a
  running server)
- `export_tiny`: the tiny model as a checkpoint folder, a draft model and a LoRA adapter

`pagedllm.cli:main` is the console script; `python -m pagedllm.cli` runs the same.
"""

from pagedllm.cli.app import DEBUG_ENV, build_parser, main

__all__ = ["DEBUG_ENV", "build_parser", "main"]
