"""Multi-LoRA: PEFT adapters loaded at start-up (`--lora-adapters`) and applied per batch row
beside the base model's linear layers, so that one forward serves several adapters and the base
model (issue 31)."""
