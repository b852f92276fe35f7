"""`klein serve --replicas N` on Ray Serve: the same HTTP API and page (`klein.serve.app`) in front of N
model replicas, each with its own pipeline and caches (docs/design.md, "Replicas").

`replica` is one model replica (a `klein.serve.service.Service` in a Serve deployment), `front` the
service the HTTP app sees in front of them (jobs, faults), `router` the Serve request router that keeps
each reference set on one replica and sends LoRAs where slots hold them (`affinity`: its decision, free
of Ray), `store` the uploaded reference images any replica can encode, `cluster` starts Ray and Serve and
stops them. Ray is imported only here, and only when `--replicas` is given (`pip install klein[ray]`).
"""
