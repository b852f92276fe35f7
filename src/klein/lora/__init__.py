"""LoRA adapters for the FLUX.2 [klein] transformer (docs/design/lora.md). Kept free of imports so that front
ends can name `LoraInfo` without loading JAX. May import what is below it (`io`, `models`, `errors`), no
request."""
