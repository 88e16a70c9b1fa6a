"""Executors: how the model runs over its ranks. `multiproc`: tensor parallelism with rank 0 in
the engine process and ranks 1..N-1 in spawned worker processes."""
