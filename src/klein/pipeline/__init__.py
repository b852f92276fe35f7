"""Running a resolved request: the stages (text, references, denoising, decoding) over the models.

Owns `flux2_klein` (`load_pipeline`, `Flux2KleinPipeline`), diffusers' methods around a call
(`diffusers_surface`: `from_pretrained`, `.to`, offloading) and its other class names
(`diffusers_pipelines`), loading the parts of a checkpoint and telling its variant (`components`,
`checkpoints`), the prompt template and tokenizer (`prompts`), the step functions
(`denoise`), the weights' place on the device (`device_weights`), the byte-bounded caches (`cache`), the
stage clock (`timing`). May import everything below it: `klein.images`,
`klein.masks`, `klein.sampling`, `klein.request`, `klein.memory`, `klein.lora`, `klein.io`, `klein.models`
and the foundation (`sharding`, `dtypes`, `version`, `errors`); never `klein.aot` nor a front end
(`klein.cli`, `klein.serve`, `klein.batch`, `klein.bench`).
"""
