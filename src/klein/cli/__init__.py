"""`klein`, the command line: `main` (the commands and `klein generate`), `flags` (the flags and key=value
words, derived from `klein.request.GenerationRequest`), `output` (progress and file names), `serve`
(`klein serve`'s flags) and `tools` (`klein plan`, `klein bench`). A front end: may import everything
below it and `klein.serve` only to start it from `klein serve`; nothing imports it.
"""
