"""Starting `klein serve --replicas N`: Ray (local, or the cluster at --ray-address), Serve's HTTP proxy,
the front and N replicas; then waiting for SIGTERM or Ctrl+C, and taking the application down."""

from __future__ import annotations

import os
import signal
import sys
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from klein import ray_runtime
from klein.serve.options import ServeOptions
from klein.serve.replicas import proxy
from klein.serve.replicas.front import APP, REPLICA, FrontDeployment
from klein.serve.replicas.replica import Replica
from klein.serve.replicas.router import ReferenceRouter

PROXY_CALLBACK = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
"""Serve's proxy reads this variable when it starts: the middlewares it wraps requests in (`proxy`). On a
cluster whose Serve is already running, its proxy keeps what it was started with."""
REPLICA_CONCURRENCY = 4
"""Requests a replica holds at once (one running, three queued on its worker); a request whose set's
replica holds as many goes to another (`router`), and with every replica full it waits at the router."""


SERVE_PATIENCE = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}
"""Seconds Ray Serve waits for a proxy's first and later health checks (its defaults: 5 and 10)."""


def serve_replicas(
    loading,
    options: ServeOptions,
    memory_limit: int | None,
    host: str,
    port: int,
    version: str,
    *,
    replicas: int,
    address: str | None,
    routing: str,
    warm=(),
) -> int:
    """Serve until SIGTERM / SIGINT, each replica compiling the `warm` shapes (`klein.pipeline.warmup`)
    before it is ready; the exit code."""
    # Serve kills a proxy that has not answered its first check within 5 s, which a small machine under load
    # exceeds (2 busy cores: the start failed with "ActorDiedError ... ProxyActor"). A local instance and its
    # workers inherit these; an operator's own values win.
    for name, seconds in SERVE_PATIENCE.items():
        os.environ.setdefault(name, seconds)
    patience = {name: os.environ[name] for name in SERVE_PATIENCE}
    ray_runtime.start(address, {PROXY_CALLBACK: proxy.IMPORT_PATH, **patience})
    # Routing by reference set, unless `load` asks for Serve's default router.
    by_reference = RequestRouterConfig(request_router_class=ReferenceRouter)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        # Serve lets a stopping replica finish what it holds for this long (the running job's --shutdown-grace)
        # before it kills it; its own default is 20 s whatever the flag says.
        grace = {"graceful_shutdown_timeout_s": options.shutdown_grace}
        replica = serve.deployment(Replica, name=REPLICA).options(
            num_replicas=replicas,
            **grace,
            max_ongoing_requests=REPLICA_CONCURRENCY,
            max_queued_requests=options.max_queue * replicas,
            ray_actor_options=ray_runtime.share(replicas),
            **({} if routing == "load" else {"request_router_config": by_reference}),
        )
        front = serve.deployment(FrontDeployment, name="Front").options(
            ray_actor_options={"num_cpus": 0}, **grace
        )
        app = front.bind(
            replica.bind(loading, options, memory_limit, version, warm), options, version, routing, replicas
        )
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        print(f"klein serve: {replicas} replicas on http://{host}:{port} (Ray Serve)", file=sys.stderr)
        stop.wait()
        print("klein serve: stopping", file=sys.stderr)
        serve.delete(APP)
    finally:
        if address is None:
            serve.shutdown()
        ray.shutdown()
    return 0
