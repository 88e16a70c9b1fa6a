"""The engine's optional parts, built from its arguments (`LLMEngine.__init__` and `_build` wire
them): the checks a model must pass before anything is loaded, the ids that end generation, the
speculative decoder and its draft model, the KV offload tier's connector and the scheduler's side
of it, and the KV-event publisher. Each returns None when its feature is off."""

from __future__ import annotations

import torch

from pagedllm.config import EngineArgs
from pagedllm.distributed.layers import check_tensor_parallel
from pagedllm.models import CheckpointError, ModelConfig, load_model_config
from pagedllm.spec_decode import SpeculativeConfig
from pagedllm.spec_decode.decoder import SpecDecoder
from pagedllm.worker.worker import check_lora_supported


def check_model_fits(args: EngineArgs, cfg: ModelConfig, device: torch.device) -> None:
    """Refuses a tensor-parallel size the model's heads (or experts) do not divide, LoRA on a
    model that cannot take it, and tensor parallelism off the CPU: before any weight is read."""
    tp = args.tensor_parallel_size
    check_tensor_parallel(cfg.num_heads, cfg.num_kv_heads, tp)
    if cfg.moe is not None:
        from pagedllm.models.moe import check_moe_tensor_parallel

        check_moe_tensor_parallel(cfg.moe, tp, args.enable_expert_parallel)
    if args.enable_lora:
        check_lora_supported(cfg)
    if tp > 1 and device.type != "cpu":
        raise ValueError(
            f"tensor_parallel_size={tp} runs on CPU only for now (device resolved to "
            f"{device}); pass device='cpu'"
        )


def eos_token_ids(cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: the checkpoint's, else the tokenizer's."""
    if cfg.eos_token_ids:
        return cfg.eos_token_ids
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    return (tokenizer_eos,) if tokenizer_eos is not None else ()


def spec_decoder(args: EngineArgs, cfg: ModelConfig, generator) -> SpecDecoder | None:
    """`speculative_config`'s decoder; a draft model's vocabulary is checked against the
    target's before either is loaded."""
    config = SpeculativeConfig.from_dict(args.speculative_config)
    if config is None:
        return None
    if config.method == "draft_model":
        try:
            draft = load_model_config(config.model)
        except CheckpointError as exc:  # else it reads like a missing --model
            raise type(exc)(f"speculative_config: the draft model: {exc}") from None
        config.check_draft_vocab(cfg.vocab_size, draft.vocab_size)
    return SpecDecoder(config, generator)


def draft_model(spec: SpecDecoder | None, *, dtype: torch.dtype, device: torch.device):
    """speculative_config method `draft_model`: the draft checkpoint, loaded like the target."""
    if spec is None or spec.config.method != "draft_model":
        return None
    from pagedllm.spec_decode.draft_model import DraftModelProposer

    c = spec.config
    return DraftModelProposer(c.model, c.num_speculative_tokens, dtype=dtype, device=device)


def kv_transfer(args: EngineArgs, cache_engine, device: torch.device):
    """kv_offloading_size: the worker connector that copies blocks in and out of the
    `cache_engine`'s tier: a host pool (exactly as many blocks as the GiB hold) or the disk
    tier's directory (its header names the cache's key calibration, `worker/kv_calibration.py`)."""
    kv_cache, calibration = cache_engine.kv_cache, cache_engine.key_calibration
    backend = args.resolved_kv_offloading_backend
    if backend is None:
        return None
    from pagedllm.kv_transfer import DiskConnector, HostKVPool, OffloadingConnector

    size = int(args.kv_offloading_size * 2**30)
    if backend == "disk":
        return DiskConnector(
            kv_cache,
            args.kv_offloading_path,
            size,
            model=args.model,
            tokenizer=args.tokenizer,
            quantization=args.quantization,
            key_calibration=calibration.digest if calibration else None,
        )
    pool = HostKVPool(
        size,
        block_shape=(2, kv_cache.shape[1], *kv_cache.shape[3:]),
        dtype=kv_cache.dtype,
        pin_memory=device.type == "cuda",
    )
    return OffloadingConnector(kv_cache, pool)


def kv_offloading_kwargs(args: EngineArgs, connector) -> dict:
    """The scheduler's side of the tier: the host pool's slots, or the disk directory."""
    if connector is None:
        return {}
    if args.resolved_kv_offloading_backend == "disk":
        return {"kv_offloading_path": args.kv_offloading_path}
    return {"kv_offloading_blocks": connector.pool.num_slots}


def kv_events_publisher(args: EngineArgs, scheduler):
    """The KV-event publisher (`kv_events_config`), the scheduler's events turned on; None when
    events are off."""
    from pagedllm.kv_events import KVEventsConfig

    config = KVEventsConfig.from_dict(args.kv_events_config)
    if config is None or not config.publishes:
        return None
    from pagedllm.kv_events.publisher import KVEventPublisher

    # the engine's KV cache is vLLM's "GPU" whatever the device (vLLM's MEDIUM_GPU): "CPU"
    # is the host tier's, so a CPU engine naming its cache "CPU" would read as tier hits
    publisher = KVEventPublisher(config, args.block_size, medium="GPU")
    scheduler.set_kv_events(True)
    return publisher
