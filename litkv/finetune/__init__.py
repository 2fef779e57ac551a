"""LoRA and full fine-tuning with gradients through the KV cache (`litkv finetune`, in `cli`)."""

from litkv.finetune.lora import (
    LoRAArgs,
    LoRALinear,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
    mark_only_lora_as_trainable,
    merge_lora,
    merged_state_dict,
)

__all__ = [
    "LoRAArgs",
    "LoRALinear",
    "apply_lora",
    "load_lora_state_dict",
    "lora_state_dict",
    "mark_only_lora_as_trainable",
    "merge_lora",
    "merged_state_dict",
]
