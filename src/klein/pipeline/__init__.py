"""Running a resolved request: the stages (text, references, denoising, decoding) over the models.

Owns `flux2_klein` (`Flux2KleinPipeline`, the stages) and what it returns (`output`), loading it
(`loading`: `load_pipeline`; what loading reads and decides, `reading`), diffusers' methods around a call
(`diffusers_surface`: the call, `from_pretrained`, `.to`, offloading) and its other class names
(`diffusers_pipelines`), the parts of a checkpoint and telling its variant (`components`,
`checkpoints`), the prompt template and tokenizer (`prompts`), the stages' programs (`programs`), the step
functions (`denoise`), the weights' place on the device (`device_weights`), the byte-bounded caches
(`cache`), the stage clock (`timing`). May import everything below it (`images`, `masks`, `sampling`, `request`,
`memory`, `lora`, `io`, `models`, `sharding`, `dtypes`, `version`, `errors`); never `klein.aot` nor a
front end.
"""
