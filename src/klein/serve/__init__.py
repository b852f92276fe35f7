"""`klein serve`: an HTTP images API over one pipeline (docs/design.md, "Serving").

`server.serve` runs it; `app.create_app` builds the routes over a `service.Service` (pipeline, caches,
worker thread, metrics). A front end: imports `klein.ray_runtime`, the pipeline and below, no other front end.
"""
