"""Who may use `klein serve` (docs/serving.md, "Security"): API keys, the exposure rule, and the Host and
Origin checks against DNS rebinding and cross-site requests."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from klein.errors import InputError

ENV_KEY = "KLEIN_API_KEY"
LOOPBACK_NAMES = ("localhost",)
WILDCARDS = ("0.0.0.0", "::", "")
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
LIMITS = ("rpm", "jobs")
OPERATOR = "operator"
"""The word after a key that lets it see every key's figures."""


@dataclasses.dataclass(frozen=True)
class ApiKey:
    secret: str = dataclasses.field(repr=False)
    label: str
    """How logs and messages name the key (its source), never the key itself."""
    rpm: int | None = None
    """Requests a minute; None: no limit."""
    jobs: int | None = None
    """Jobs queued or running at once; None: no limit."""
    operator: bool = False
    """Sees every key's figures (/metrics, /v1/config, /v1/loras); another key sees its own and the sums."""


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may use the server and from where: what `klein serve` was told."""

    keys: tuple[ApiKey, ...] = ()
    host: str = "127.0.0.1"
    """The address the server listens on."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names accepted in the Host header besides the bound address and loopback."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins (scheme://host[:port]) that may call the API from a browser, CORS included."""

    def match(self, authorization: str) -> ApiKey | None:
        """The key an `Authorization: Bearer KEY` header gives (the scheme in any case), or None. Every
        key is compared in constant time, and all of them, so the time says nothing of which matched."""
        scheme, _, given = authorization.strip().partition(" ")
        found = None
        for key in self.keys:
            equal = hmac.compare_digest(given.strip().encode(), key.secret.encode())
            if equal and scheme.lower() == "bearer":
                found = key
        return found

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a keyless server answers a request with this Host header."""
        if host_header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = _host_name(host_header)
        if name is None:
            return False
        if name in LOOPBACK_NAMES or name == self.host.lower() or name in self.allowed_hosts:
            return True
        address = _address(name)
        # Bound to every interface, the server is reached by any of this machine's addresses; a rebinding
        # page sends a name, never an address.
        return address is not None and (address.is_loopback or self.host in WILDCARDS)

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a request from a page of `origin` may change state here."""
        if origin.lower() in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        own = host_header is not None and parts.netloc.lower() == host_header.strip().lower()
        return own and parts.scheme in ("http", "https")

    def cors(self, origin: str | None) -> dict[str, str]:
        """The CORS response headers for a request from `origin`: none unless it is an allowed one."""
        if origin is None or origin.lower() not in self.allowed_origins:
            return {}
        return {
            "Access-Control-Allow-Origin": origin,
            "Vary": "Origin",
            "Access-Control-Expose-Headers": "Retry-After",
        }


def loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) is reachable from this machine only."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    address = _address(host)
    return address is not None and address.is_loopback


def exposure_warning(host: str, keys: tuple[ApiKey, ...], insecure: bool) -> str | None:
    """Refuse (`InputError`) to serve beyond loopback without a key unless `insecure`; the warning to print
    at start when it serves without a key because of `insecure`."""
    if keys or (not insecure and loopback(host)):
        return None
    if not insecure:
        raise InputError(
            f"--host {host} would serve to the network without an API key: give one with --api-key-file FILE, "
            f"the environment variable {ENV_KEY} or --api-key KEY, or pass --insecure-no-key to serve it open"
        )
    return (
        f"klein serve: WARNING: --insecure-no-key: no API key, anyone who reaches {host} may use this server"
    )


def read_keys(flag: str | None, file: str | None, environ=os.environ) -> tuple[ApiKey, ...]:
    """The keys of --api-key, KLEIN_API_KEY and --api-key-file, each a key line (`KEY rpm=N jobs=N`)."""
    keys = []
    if flag is not None:
        keys.append(parse_key_line(flag, "--api-key"))
    if environ.get(ENV_KEY, "").strip():
        keys.append(parse_key_line(environ[ENV_KEY], ENV_KEY))
    if file is not None:
        keys += _read_key_file(Path(file))
    if len({key.secret for key in keys}) < len(keys):
        raise InputError("the same API key is given twice (--api-key, KLEIN_API_KEY, --api-key-file)")
    return tuple(keys)


def _read_key_file(path: Path) -> list[ApiKey]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--api-key-file {path}: cannot read it ({error})") from None
    keys = [
        parse_key_line(line, f"{path} line {number}", f"--api-key-file line {number}")
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not keys:
        raise InputError(f"--api-key-file {path}: no key in it (one key a line, e.g. 'KEY rpm=60 jobs=2')")
    return keys


def parse_key_line(line: str, where: str, label: str | None = None) -> ApiKey:
    """`KEY [rpm=N] [jobs=N] [operator]` -> an `ApiKey` labelled `label` (else `where`, which errors
    name)."""
    if not line.split():
        raise InputError(f"{where}: the key is empty")
    secret, *words = line.split()
    limits = {}
    operator = OPERATOR in words
    for word in (word for word in words if word != OPERATOR):
        name, _, value = word.partition("=")
        if name not in LIMITS or not re.fullmatch(r"[1-9][0-9]{0,8}", value) or name in limits:
            raise InputError(
                f"{where}: {word!r} is not a key limit; after the key come rpm=N (requests a minute), "
                "jobs=N (jobs at once) and the word operator (it sees every key's figures), each at most once"
            )
        limits[name] = int(value)
    if words.count(OPERATOR) > 1:
        raise InputError(f"{where}: 'operator' is given twice; give it once")
    return ApiKey(secret, label or where, **limits, operator=operator)


def read_list(text: str | None, what: str) -> tuple[str, ...]:
    """A comma-separated flag value -> lower-case entries; `what` is "hosts" or "origins"."""
    entries = tuple(each.strip().lower().rstrip("/") for each in (text or "").split(",") if each.strip())
    for entry in entries:
        parts = urlsplit(entry)
        if what == "origins" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
            raise InputError(
                f"--allowed-origins: {entry!r} is not an origin; give scheme://host[:port], e.g. "
                "https://app.example.com"
            )
        if what == "hosts" and _host_name(entry) != entry:
            raise InputError(
                f"--allowed-hosts: {entry!r} is not a host name; give names like images.example.com"
            )
    return entries


def _host_name(host_header: str) -> str | None:
    """The name or address of a Host header ("[::1]:8000" -> "::1"), lower-case; None if unreadable."""
    try:
        return urlsplit("//" + host_header.strip()).hostname
    except ValueError:
        return None


def _address(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None
