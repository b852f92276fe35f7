"""What a user asks for, and every decision about it.

Owns the request type (`request.GenerationRequest`, and `request.Settings`, the record of what ran), the
kinds its settings travel as text (`kinds`), the generation modes (`modes`), the encoded references a
request may carry (`references`), the loading options (`loading`), `resolve.resolve`, the one place where
mode, size, steps, guidance, seed, batch and reference count are decided and checked, and `klein plan`'s
question planned (`planning`). Pure: no device, no file, no JAX computation. May import what is below it
(`memory`: the planner, the residency policies; `lora`, `io`, `models`, `dtypes`, `errors`), nothing above.
"""
