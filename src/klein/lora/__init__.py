"""LoRA adapters for the FLUX.2 [klein] transformer: files (`files`), their key layouts (`layouts`), where
their modules land in the model (`targets`), merging them into the weights (`merge`), and the two steps a
pipeline takes (`loading`: read a file, map it onto a model). Kept free of imports so that front ends can
name `LoraInfo` without loading JAX. May import what is below it (`io`, `models`, `errors`), no request."""
