"""The `pagedllm` command line: `generate`, `bench`, `serve` and `export-tiny`.

- `app`: the argument parser, the commands and the one-line error reporting (`main`)
- `bench`: the offline throughput benchmark behind `pagedllm bench` (`bench_serve`: against a
  running server)
- `export_tiny`: the tiny model as a checkpoint folder, a draft model and a LoRA adapter

`pagedllm.cli:main` is the console script; `python -m pagedllm.cli` runs the same.
"""

from pagedllm.cli.app import DEBUG_ENV, build_parser, main

__all__ = ["DEBUG_ENV", "build_parser", "main"]
