"""`python -m pagedllm.cli`: the `pagedllm` command."""

import sys

from pagedllm.cli.app import main

if __name__ == "__main__":
    sys.exit(main())
