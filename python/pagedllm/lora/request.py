"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter in a local folder (`adapter_config.json` +
    `adapter_model.safetensors`).

    `lora_int_id` (>= 1) identifies the adapter to the scheduler, the device slots and the prefix
    cache: requests with the same id share the loaded weights and their cached prefixes, so one
    id must always name the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest: lora_name must be a non-empty str, got {self.lora_name!r}"
            )
        bad_id = not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
        if bad_id or not 1 <= self.lora_int_id < 2**63:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be an int in [1, 2**63), got "
                f"{self.lora_int_id!r} (0 is the base model)"
            )
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_path must be a folder path, got "
                f"{self.lora_path!r}"
            )
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
