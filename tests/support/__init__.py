"""What the tests share; nothing here is collected by pytest (no module is named test_*).

Tiny checkpoints, built from random weights (nothing is downloaded):
    strengthen         random weights large enough that parity tests cannot pass vacuously
    tiny_transformer   a Flux2Transformer2DModel in the diffusers layout
    tiny_vae           an AutoencoderKLFlux2 in the diffusers layout
    tiny_text_encoder  a Qwen3 text encoder and its byte-level BPE tokenizer
    tiny_pipeline      whole Flux2KleinPipeline / Flux2KleinKVPipeline folders of the three above
    bfl_files          single-file checkpoints from a diffusers model: BFL naming, BFL FP8, GGUF
    lora_files         random LoRA files in each layout FLUX.2 trainers use

Comparing:
    compare            max_abs, rel_err (max abs error over the reference's max) and assert_close

Inputs and calls:
    transformer_inputs tokens and position ids, and one call made on diffusers' model and on ours
    single_file_cases  one forward pass of ours and of diffusers on a single-file checkpoint

Processes:
    serve_process      `klein serve` as a real process on a free port (start, stop, metrics, log)
    distributed_worker one process of a sharded generation (`python -m tests.support.distributed_worker`)
    on_eight_devices   tests run by tests/test_sharding.py in a child pytest on 8 simulated devices
"""
