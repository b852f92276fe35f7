"""What a user asks for, and every decision about it.

Owns the request type (`request.GenerationRequest`, and `request.Settings`, the record of what ran), the
kinds its settings travel as text (`kinds`), the generation modes
(`modes`), the encoded references a request may carry (`references`), the loading options (`loading`) and
`resolve.resolve`, the one place where mode, size, steps, guidance, seed, batch and reference count are
decided and checked. Pure: no device, no file, no JAX computation. May import `klein.errors`,
`klein.models` (configs and types only) and `klein.lora.files` (LoRA descriptions); nothing above it.
"""
