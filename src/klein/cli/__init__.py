"""`klein`, the command line: `main` (the commands and `klein generate`), `flags` (the flags and key=value
words, derived from `klein.request.GenerationRequest`), `output` (progress and file names), `serve`
(`klein serve`'s flags) and `tools` (`klein plan`, `klein bench`). The top of the order: may import everything
below it, `klein.serve` and `klein.batch` only to start them (from `serve` and `batch`); nothing imports it.
"""
