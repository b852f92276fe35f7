"""`klein bench`: klein and diffusers side by side on the same random weights, and the KV speedup
against its FLOP ceiling. `configs` (what to run), `cases` (the cases and their inputs), `flops` (the
ceiling), `engines` (the two engines), `runner` (measuring), `report` (JSON, Markdown, PNG). A front end:
may import `klein.aot` (the targets the roofline times), the pipeline and below; never `klein.serve` nor
`klein.batch` (beside it), nor the command line.
"""
