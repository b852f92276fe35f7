"""`klein serve --replicas N` on Ray Serve (docs/design/serving.md, "Replicas"): Ray is imported only here,
and only when `--replicas` is given."""
