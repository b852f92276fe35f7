"""Joining Ray for the front ends that scale out (`klein serve --replicas`, `klein batch --ray`).

Imported only by those commands: Ray is an optional extra.
"""

from __future__ import annotations

import os

import ray

from klein.errors import InputError

FORWARDED = ("KLEIN_HOME", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE", "XLA_FLAGS")


def start(address: str | None, settings: dict[str, str] | None = None) -> None:
    """`ray.init` at `address` (None: a local instance of its own, never another process's running one:
    `ray.init()` would join it, and die with it), forwarding klein's variables to the workers, with
    `settings` (more variables) beside them."""
    env = {name: os.environ[name] for name in FORWARDED if name in os.environ} | (settings or {})
    env |= {name: value for name, value in os.environ.items() if name.startswith("JAX_")}
    try:
        ray.init(
            address=address or "local",
            runtime_env={"env_vars": env},
            include_dashboard=False,
            log_to_driver=False,
        )
    except ConnectionError as error:
        raise InputError(f"--ray-address {address}: cannot join the Ray cluster ({error})") from None


def devices() -> int:
    """Accelerators in the cluster (GPUs), or 0."""
    return int(ray.cluster_resources().get("GPU", 0))


def share(workers: int) -> dict:
    """Resources of one of `workers` model holders: an accelerator each where there are any, else an
    equal share of the CPUs (JAX uses every core it sees; the share keeps Ray's accounting honest)."""
    if devices() >= 1:
        return {"num_gpus": 1, "num_cpus": 0}
    return {"num_cpus": min(1.0, ray.cluster_resources().get("CPU", 1) / workers)}
