"""LoRA adapters for the FLUX.2 [klein] transformer: files (`files`), their key layouts (`layouts`), where
their modules land in the model (`targets`), merging them into the weights (`merge`), and the two steps a
pipeline takes (`loading`: read a file, map it onto a model), the adapter slots of unmerged LoRAs (`slots`)
and the names an operator offers (`registry`). Kept free of imports so that front ends can name `LoraInfo`
without loading JAX. May import what is below it (`klein.io`, `klein.models`, `klein.errors`); nothing
above it: a request's LoRAs (`klein.request.loras`) import what they need from here."""
