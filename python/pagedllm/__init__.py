"""pagedllm: a compact, fast LLM inference engine."""
from pagedllm._core import __version__

__all__ = ["__version__"]
