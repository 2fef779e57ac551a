"""LoRA and full fine-tuning with gradients through the KV cache: the training library (the `litkv finetune`
command is `litkv.cli.finetune_cmd`)."""

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
