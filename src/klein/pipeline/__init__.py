"""Running a resolved request: the stages (text, references, denoising, decoding) over the models, loading
the pipeline (`loading`, `reading`), diffusers' methods around a call (`diffusers_surface`,
`diffusers_pipelines`) and the parts of a checkpoint (`components`, `checkpoints`). May import everything
below it (`images`, `masks`, `sampling`, `request`, `memory`, `lora`, `io`, `models`, `sharding`, `dtypes`,
`version`, `errors`); never `klein.aot` nor a front end.
"""
