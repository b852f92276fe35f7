"""`klein serve`: an HTTP images API over one pipeline (docs/design.md, "Serving").

`server.serve` runs it; `app.create_app` builds the routes over a `service.Service` (pipeline, caches,
worker thread, metrics). A front end: may import `klein.ray_runtime` (replicas on Ray Serve), the pipeline and
below; never `klein.batch` nor `klein.bench` (beside it), nor the command line, which starts it.
"""
