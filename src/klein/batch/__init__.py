"""`klein batch`: a file of requests, one JSON object a line, run to PNG files with a manifest.

`lines` reads the file into requests (the fields of `klein.GenerationRequest`, as the request type reads
them), `plan` decides what is left to do and groups it by reference set, `outputs` names and writes the
PNGs atomically, `manifest` keeps `results.jsonl`, `runner` is one worker's pipeline over one group at a
time (each set encoded once), and `local` runs every group in this process (`ray_data` on a Ray cluster).
A front end: imports `klein.ray_runtime`, the pipeline and below, no other front end; the command line
starts it (docs/design.md, "Batch").
"""
