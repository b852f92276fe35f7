"""Starting `klein serve --replicas N`: Ray (a local instance started and stopped with the command, or
the cluster at --ray-address), Serve's HTTP proxy on host:port, the front and N replicas; then waiting
for SIGTERM or Ctrl+C, and taking the application down.

Each replica gets a device of its own where the cluster has accelerators (one GPU each), otherwise an
equal share of the CPUs (JAX uses every core it sees; the share only keeps Ray's accounting honest).
The variables klein reads (KLEIN_HOME, JAX_*, PYTHONPATH, HF_*) travel to the replicas with the job.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import ray
from ray import serve

from klein.errors import InputError
from klein.serve.options import ServeOptions
from klein.serve.replicas.front import APP, REPLICA, FrontDeployment
from klein.serve.replicas.replica import Replica

FORWARDED = ("KLEIN_HOME", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "XLA_FLAGS")
REPLICA_CONCURRENCY = 4
"""Requests a replica holds at once (one running, three queued on its worker); more wait at the router,
and one whose set's replicas are all full goes to another after Serve's short matching wait."""


def serve_replicas(
    loading,
    options: ServeOptions,
    memory_limit,
    host: str,
    port: int,
    version: str,
    *,
    replicas: int,
    address: str | None,
    routing: str,
) -> int:
    """Serve until SIGTERM / SIGINT; the exit code."""
    _start_ray(address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        replica = serve.deployment(Replica, name=REPLICA).options(
            num_replicas=replicas,
            max_ongoing_requests=REPLICA_CONCURRENCY,
            max_queued_requests=options.max_queue * replicas,
            ray_actor_options=_resources(replicas),
        )
        front = serve.deployment(FrontDeployment, name="Front").options(ray_actor_options={"num_cpus": 0})
        app = front.bind(
            replica.bind(loading, options, memory_limit, version), options, version, routing, replicas
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


def _start_ray(address: str | None) -> None:
    env = {name: os.environ[name] for name in FORWARDED if name in os.environ}
    env |= {name: value for name, value in os.environ.items() if name.startswith("JAX_")}
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, include_dashboard=False, log_to_driver=False)
    except ConnectionError as error:
        raise InputError(f"--ray-address {address}: cannot join the Ray cluster ({error})") from None


def _resources(replicas: int) -> dict:
    """One accelerator per replica where there are any, else an equal share of the CPUs."""
    available = ray.cluster_resources()
    if available.get("GPU", 0) >= 1:
        return {"num_gpus": 1, "num_cpus": 0}
    return {"num_cpus": min(1.0, available.get("CPU", 1) / replicas)}
