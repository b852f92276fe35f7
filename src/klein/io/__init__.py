"""Every file format klein reads or writes: safetensors (sharded, memory-light), diffusers and BFL key
layouts, FP8 and GGUF transformers, the text encoder and VAE checkpoints, JSON configs, PNG metadata, the
built-in demo checkpoint (`demo`) and klein's own folder (`paths`). May import what is below it (`models`:
to build a model from its tensors, the variants' catalog; `sharding`, `dtypes`, `errors`), nothing above.
"""
