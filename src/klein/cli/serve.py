"""`klein serve`: the HTTP service (`klein.serve`), with every model flag of `klein generate`; FastAPI and
uvicorn are imported only when it runs, so that `klein --help` stays quick."""

from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import sys

from klein.cli import extras, interrupts
from klein.cli import flags as cli_flags
from klein.errors import InputError
from klein.images import MIN_SIDE as MIN_REFERENCE_SIDE
from klein.images import show_pixels
from klein.pipeline import warmup
from klein.request.kinds import parse_size
from klein.request.resolve import DEFAULT_SIZE, MULTIPLE
from klein.serve import security
from klein.serve.options import ServeOptions, show_size
from klein.version import version

DESCRIPTION = """\
Serve an OpenAI-compatible images API (POST /v1/images/generations, /v1/images/edits), reference
sets kept encoded across requests (POST /v1/references), jobs with progress events (/v1/jobs), /healthz,
/metrics (Prometheus) and OpenAPI docs at /docs. One worker owns the device; requests queue. With
--replicas N, N replicas on Ray Serve, each with its own pipeline and caches, a reference set's requests
sent to the replica that holds it.

Without --model it serves the offline demo checkpoint (tiny random weights: images are noise-like).
SIZE is bytes or KiB/MiB/GiB (e.g. 512MiB). It binds 127.0.0.1 unless --host says otherwise; another
--host needs an API key (--api-key-file, KLEIN_API_KEY or --api-key) or --insecure-no-key. Without a key,
a request naming another Host than this server's is refused (403); with or without one, a POST or DELETE
from a web page of another origin than --allowed-origins is refused (403)."""

EXAMPLES = """\
examples:
  klein serve                                                    # demo checkpoint, port 8000
  KLEIN_API_KEY=$(cat key.txt) klein serve --host 0.0.0.0 --model black-forest-labs/FLUX.2-klein-9b-kv
  klein serve --host 0.0.0.0 --api-key-file keys.txt          # a key a line: KEY [rpm=N] [jobs=N] [operator]
  klein serve --replicas 2 --model black-forest-labs/FLUX.2-klein-9b-kv  # 2 replicas on a local Ray
  curl -s localhost:8000/v1/images/generations -H 'Content-Type: application/json' \\
      -d '{"prompt": "a red fox", "size": "512x512", "seed": 7}'"""
EXAMPLES += """

SIGTERM and Ctrl+C stop gracefully: nothing new is accepted, queued jobs and clients still sending a body get
503, and the running job has --shutdown-grace seconds to finish: exit 0. Past them, or at a second signal,
klein stops at once: exit 143 after SIGTERM, 130 after Ctrl+C (the running job's client gets no answer).
Compiling ahead, or a request's own programs behind the requests, with no job running: either signal stops
it at once, exit 0."""


def serve_parser() -> argparse.ArgumentParser:
    parser = cli_flags.Parser(
        prog="klein serve",
        description=DESCRIPTION,
        epilog=EXAMPLES,
    )
    add = parser.add_argument
    cli_flags.add_flags(add, cli_flags.LOADING)
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    add("--port", type=int, default=8000, help="port (default: 8000)")
    add(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /healthz and the page (other local users "
        "can read a flag in ps: prefer KLEIN_API_KEY or --api-key-file); 'KEY rpm=N jobs=N' adds limits",
    )
    add(
        "--memory-limit",
        type=parse_size,
        metavar="SIZE",
        help="bytes a request may use beyond the weights, whatever is free (--memory-cap bounds klein as a whole)",
    )
    add(
        "--replicas",
        type=int,
        metavar="N",
        help="serve N model replicas on Ray Serve, each with its own pipeline and caches, requests routed "
        "by reference set (needs pip install 'klein[ray]'); default: one pipeline in this process",
    )
    add(
        "--ray-address", metavar="ADDRESS", help="with --replicas: join this Ray cluster (default: local Ray)"
    )
    add(
        "--routing",
        choices=("references", "load"),
        help="with --replicas: references (default) sends a set's requests to the replica that holds it; "
        "load is Serve's default router (queue lengths only), for comparison",
    )
    _add_access_flags(add)
    _add_warm_flags(add)
    defaults = ServeOptions()
    for name, help_ in _LIMITS.items():
        field = name.replace("-", "_")
        sized = field.endswith("bytes") or field in RATES
        default = getattr(defaults, field)
        seconds = isinstance(default, float)
        add(
            f"--{name}",
            type=parse_size if sized else float if seconds else int,
            default=default,
            metavar="SIZE" if sized else "SECONDS" if seconds else "N",
            help=f"{help_} (default: {_shown(field, default)})",
        )
    return parser


def _shown(field: str, default) -> str:
    """A default as a person reads it (2GiB, 2048x2048 px), not a raw count."""
    if field.endswith("bytes"):
        return show_size(default)
    if field in RATES:
        return f"{show_size(default)}/s"
    return show_pixels(default) if field == "max_pixels" else str(default)


def _add_access_flags(add) -> None:
    add(
        "--api-key-file",
        metavar="FILE",
        help="API keys, one a line: KEY, optionally followed by rpm=N (requests a minute) and jobs=N (jobs "
        "at once), each exceeded one a 429 with Retry-After; # starts a comment",
    )
    add(
        "--insecure-no-key",
        action="store_true",
        help="serve a non-loopback --host without an API key (anyone who reaches it may use it; warned at start)",
    )
    add(
        "--allowed-hosts",
        metavar="NAMES",
        help="comma-separated host names clients may reach a keyless server by, besides its address and "
        "localhost (others get 403: DNS rebinding)",
    )
    add(
        "--allowed-origins",
        metavar="ORIGINS",
        help="comma-separated web origins (https://app.example.com) whose pages may call the API; they get CORS "
        "headers (default: only the server's own page)",
    )


def _add_warm_flags(add) -> None:
    add(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="answer at once and compile each program when a request first needs it (tests, quick starts); "
        "by default the server compiles ahead, /healthz saying 'warming' (503) until done",
    )
    add(
        "--warm-size",
        type=_warm_sizes,
        default=((DEFAULT_SIZE, DEFAULT_SIZE),),
        metavar="WxH[,WxH...]",
        help=f"sizes compiled ahead, each with 0 to {warmup.REFERENCES} references (at most --max-references) "
        "of it, each batch up to --max-batch and an inpainting; a program serves every size of its token "
        "buckets, so the default also covers every photo over 1 MP (resized to 1024^2's area), any aspect; "
        "a request of other buckets runs at once on the smallest warm ones that hold it while its own compile "
        f"in the background (default: {DEFAULT_SIZE}x{DEFAULT_SIZE})",
    )


def _warm_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """ "WxH[,WxH...]" -> ((width, height), ...), each side a multiple of 16 px and at least a reference's
    smallest."""
    sizes = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d{1,5})x(\d{1,5})", part.strip())
        sides = (int(match.group(1)), int(match.group(2))) if match else ()
        if not sides or any(side < MIN_REFERENCE_SIDE or side % MULTIPLE for side in sides):
            raise argparse.ArgumentTypeError(
                f"{part!r}: give WxH in px, each side a multiple of {MULTIPLE} and at least "
                f"{MIN_REFERENCE_SIDE} (several: 1024x1024,768x512)"
            )
        sizes.append(sides)
    return tuple(sizes)


def warm_shapes(flags: argparse.Namespace, options: ServeOptions) -> tuple[warmup.Shape, ...]:
    """What the server compiles before it is ready (`klein.pipeline.warmup`): none with --no-warm."""
    if not flags.warm:
        return ()
    references = min(options.max_references, warmup.REFERENCES)
    return warmup.at_sizes(references, range(1, options.max_batch + 1), flags.warm_size)


_LIMITS = {
    "cache-bytes": "reference cache budget: per-image latents and encoded sets, in device bytes",
    "prompt-cache-bytes": "prompt-embedding cache budget, in device bytes",
    "max-queue": "requests that may wait for the worker; more get 429 with Retry-After",
    "max-upload-bytes": "largest multipart body (413 beyond, checked while it streams; JSON bodies: 1 MiB at most)",
    "max-references": "most reference images in one request or set",
    "max-pixels": "largest image accepted or generated, width x height",
    "max-steps": "most denoising steps a request may ask for",
    "lora-bytes": "device bytes for the adapter slots of the LoRAs requests name: up to 4 on the device at "
    "once, fewer if their slots do not fit; a LoRA whose slot alone does not fit stops the server",
    "max-batch": "queued requests of one size, steps and reference set run as one batch of up to N images "
    "(equal to each alone up to float rounding, not bit for bit); 1: off",
    "max-result-bytes": "finished /v1/jobs results kept, in bytes of their images; the oldest leave first",
    "result-ttl": "seconds a finished /v1/jobs result is kept; then GET /v1/jobs/ID says it expired",
    "job-timeout": "seconds a job may run; past it, it stops at its next denoising step (504)",
    "max-event-streams": "open /v1/jobs/ID/events streams; more get 429 with Retry-After",
    "limit-concurrency": "connections open at once; past them a new one closes the oldest idle connection "
    "that has shown no API key, or gets 503 if none is",
    "max-unauthenticated": "connections open at once that have shown no valid API key (without keys: that have "
    "sent no request); past them a new one closes the oldest idle one of them, or gets 503 if none is",
    "keep-alive-timeout": "seconds an idle HTTP connection stays open between requests",
    "header-timeout": "seconds a connection has to send a request's headers, from its opening or the request's "
    "first byte; then it is closed",
    "min-body-rate": "bytes a second a request body must arrive at, over every 5 s; a slower client gets 408 "
    "and is cut",
    "upload-budget-bytes": "bytes of request bodies being received at once, all clients together, each body "
    "counted by its Content-Length (or its cap) from its headers; one past them gets 429 with Retry-After "
    "before it is read",
    "shutdown-grace": "seconds the running job has to finish after SIGTERM or Ctrl+C; then klein stops at once",
}
RATES = ("min_body_rate",)
"""The limits in bytes a second: SIZE text, shown with /s."""


def serve_command(flags: argparse.Namespace) -> int:
    names = {field.name for field in dataclasses.fields(ServeOptions)}
    options = ServeOptions(**{k: v for k, v in vars(flags).items() if k in names}, access=_access(flags))
    loading = cli_flags.load_options(flags)
    if flags.replicas is None:
        if flags.ray_address is not None or flags.routing is not None:
            raise InputError("--ray-address and --routing go with --replicas N")
        return _serve_here(flags, options, loading)
    if flags.replicas < 1:
        raise InputError(f"--replicas must be a positive number, got {flags.replicas}")
    extras.require("ray", "ray", "--replicas")
    from klein.pipeline.reading import locate
    from klein.serve.replicas.cluster import serve_replicas
    from klein.serve.server import bind

    for sock in bind(flags.host, flags.port):  # a port in use is said now, not once Ray Serve starts
        sock.close()
    locate(loading)  # a wrong --model is refused here, not by each replica in turn

    return serve_replicas(
        loading,
        options,
        flags.memory_limit,
        flags.host,
        flags.port,
        version(),
        replicas=flags.replicas,
        address=flags.ray_address,
        routing=flags.routing or "references",
        warm=warm_shapes(flags, options),
    )


def _access(flags: argparse.Namespace) -> security.Access:
    """Keys and the Host and Origin rules; refused (exit 2) before anything loads or binds when the host
    is not loopback and there is no key, unless --insecure-no-key, which is warned of at every start."""
    keys = security.read_keys(flags.api_key, flags.api_key_file)
    warning = security.exposure_warning(flags.host, keys, flags.insecure_no_key)
    if warning:
        print(warning, file=sys.stderr)
    return security.Access(
        keys,
        flags.host.lower(),
        security.read_list(flags.allowed_hosts, "hosts"),
        security.read_list(flags.allowed_origins, "origins"),
    )


def _serve_here(flags: argparse.Namespace, options: ServeOptions, loading) -> int:
    """One pipeline in this process (`klein.serve.server`)."""
    from klein.pipeline.loading import load
    from klein.serve.server import StopNotice, bind, serve, while_loading

    sockets = bind(flags.host, flags.port)  # a port in use is said now, not after the load and warm-up
    what = loading.transformer or loading.model or "demo"
    print(f"klein serve: loading {what} (meanwhile requests are answered 503, loading)", file=sys.stderr)
    notice = StopNotice(options.shutdown_grace)
    with interrupts.stoppable(options.shutdown_grace, notice, (signal.SIGINT, signal.SIGTERM)):
        with while_loading(sockets):  # the port listens from now on
            pipe = load(loading)
        pipe.memory_limit = flags.memory_limit
        # While it serves, uvicorn's handler takes Ctrl+C (a graceful stop, as SIGTERM's) and raises it again
        # once stopped, to the handler it found: ignored, rather than a KeyboardInterrupt (exit 130) after a
        # clean stop. The watch of `stoppable` still sees every Ctrl+C and SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        warm = warm_shapes(flags, options)
        return serve(pipe, options, flags.host, flags.port, version(), warm, notice, sockets)
