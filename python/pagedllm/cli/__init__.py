"""The `pagedllm` command line: `pagedllm generate` and `pagedllm bench`.

- `app`: the argument parser, the two commands and the one-line error reporting (`main`)
- `bench`: the offline throughput benchmark behind `pagedllm bench`

`pagedllm.cli:main` is the console script; `python -m pagedllm.cli` runs the same.
"""

from pagedllm.cli.app import DEBUG_ENV, build_parser, main

__all__ = ["DEBUG_ENV", "build_parser", "main"]
