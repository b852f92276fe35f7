"""`klein serve --replicas N` on Ray Serve: the same HTTP API and page (`klein.serve.app`) in front of N
model replicas (docs/design/serving.md, "Replicas"). Ray is imported only here, and only when
`--replicas` is given (`pip install klein[ray]`)."""
