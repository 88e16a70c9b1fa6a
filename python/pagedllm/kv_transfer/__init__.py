"""The workers' side of a second KV tier (vLLM V1's KV connector, worker half).

Two tiers: the native host pool (`host_pool.py`, `worker.OffloadingConnector`) and the disk
tier (`disk.py`). The scheduler (Rust, `crate::connector`) decides what moves: each step's
output carries the loads (tier slot -> device block) and saves (device block -> tier slot) as
arrays. The worker connector here runs them off the engine thread and reports finished
transfers (`get_finished`), which the engine feeds back to the scheduler.
"""

from pagedllm.kv_transfer.disk import DiskConnector
from pagedllm.kv_transfer.host_pool import HostKVPool
from pagedllm.kv_transfer.worker import OffloadingConnector

__all__ = ["DiskConnector", "HostKVPool", "OffloadingConnector"]
