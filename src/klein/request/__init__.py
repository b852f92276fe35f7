"""What a user asks for, and every decision about it: the request type, its settings' text forms, the modes,
the loading options, `resolve.resolve` and `klein plan`'s question (`planning`); docs/design/requests.md.
Pure: no device, no file, no JAX computation. May import what is below it (`memory`, `lora`, `io`,
`models`, `dtypes`, `errors`), nothing above.
"""
