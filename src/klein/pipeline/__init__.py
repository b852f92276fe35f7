"""Running a resolved request: the stages (text, references, denoising, decoding) over the models.

Owns `flux2_klein` (`Flux2KleinPipeline`, the stages) and what it returns (`output`), loading it
(`loading`: `load_pipeline`; what loading reads and decides, `reading`), diffusers' methods around a call
(`diffusers_surface`: the call, `from_pretrained`, `.to`, offloading) and its other class names
(`diffusers_pipelines`), the parts of a checkpoint and telling its variant (`components`,
`checkpoints`), the prompt template and tokenizer (`prompts`), the stages' programs (`programs`), the step
functions (`denoise`), the weights' place on the device (`device_weights`), the byte-bounded caches
(`cache`), the stage clock (`timing`). May import `klein.request`, `klein.memory`, `klein.models`, `klein.io`,
`klein.lora` and the shared top-level modules (`images`, `sampling`, `sharding`, `dtypes`, `errors`); never
a front end (`klein.cli`, `klein.serve`, `klein.bench`).
"""
