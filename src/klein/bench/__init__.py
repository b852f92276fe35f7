"""`klein bench`: klein and diffusers side by side on the same random weights, and the KV speedup
against its FLOP ceiling. `configs` (what to run), `cases` (the cases and their inputs), `flops` (the
ceiling), `engines` (the two engines), `runner` (measuring), `report` (JSON, Markdown, PNG). A front end:
imports `klein.aot` (the roofline's targets), the pipeline and below, no other front end.
"""
