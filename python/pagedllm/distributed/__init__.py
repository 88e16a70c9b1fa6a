"""Tensor parallelism: the ranks' process group (`parallel_state`) and the sharded layers the
decoder builds when `tensor_parallel_size > 1` (`layers`)."""
