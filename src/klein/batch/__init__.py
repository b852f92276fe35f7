"""`klein batch`: a file of requests, one JSON object a line, run to PNG files with a manifest
(docs/design/serving.md, "Batch"). A front end: imports `klein.ray_runtime`, the pipeline and below, no
other front end; the command line starts it.
"""
