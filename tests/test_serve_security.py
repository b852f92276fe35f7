"""`klein serve` safe to expose (issue 34 items 2 and 3), against real servers on 127.0.0.1: a network
--host refused without a key, keys from the environment (never in /proc/PID/cmdline) and a key file with
per-key limits, the Bearer scheme in any case, and the Host and Origin checks (DNS rebinding, cross-site
POSTs) with CORS only for --allowed-origins. The rules themselves (key lines, Host names, the quotas' token
bucket on a fake clock) are also checked in-process, and the EPS refusal before Pillow's Ghostscript call."""

import os
import subprocess
import sys
import time

import httpx
import PIL.EpsImagePlugin
import pytest

from klein import images
from klein.cli import main as cli
from klein.errors import InputError
from klein.serve.errors import ApiError
from klein.serve.quotas import Quotas
from klein.serve.security import Access, ApiKey, exposure_warning, parse_key_line, read_keys
from tests.support.serve_process import free_port, job_status, log_of, start, stop
from tests.test_serve_errors import EPS, chunked

ENV_KEY = "env-secret-3f9a1c"
KEY_FILE = "# the tests' keys\nalpha-key rpm=2\n\nbeta-key jobs=1\ngamma-key\n"
SHORT = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}
LONGER = {"prompt": "a slow fox", "size": "256x256", "num_inference_steps": 8, "seed": 2}


def bearer(key: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {key}"}


@pytest.fixture(scope="module")
def keyed(klein_home, tmp_path_factory):
    """(process, URL) of a server with a key from the environment and three from a file."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(KEY_FILE)
    process, url = start(klein_home, "--api-key-file", str(key_file), env={"KLEIN_API_KEY": ENV_KEY})
    yield process, url
    stop(process)


@pytest.fixture(scope="module")
def keyless(klein_home):
    """(process, URL) of a server without a key, one more host name and one web origin allowed."""
    flags = (
        "--insecure-no-key",
        "--allowed-hosts",
        "images.example",
        "--allowed-origins",
        "https://app.example",
    )
    process, url = start(klein_home, *flags)
    yield process, url
    stop(process)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_network_host_without_a_key_exits_2_before_loading_or_binding(host):
    command = [sys.executable, "-m", "klein.cli.main", "serve", "--host", host, "--port", str(free_port())]
    env = {name: value for name, value in os.environ.items() if name != "KLEIN_API_KEY"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    for words in ("--api-key-file", "KLEIN_API_KEY", "--api-key KEY", "--insecure-no-key"):
        assert words in done.stderr
    assert "loading" not in done.stderr and done.stderr.count("\n") == 1


def test_the_environment_key_guards_the_server_and_is_not_on_its_command_line(keyed):
    process, url = keyed
    command_line = open(f"/proc/{process.pid}/cmdline", "rb").read()
    assert b"serve" in command_line and b"--api-key-file" in command_line
    for secret in (ENV_KEY, "alpha-key", "beta-key", "gamma-key"):
        assert secret.encode() not in command_line
    assert httpx.get(url + "/v1/config").status_code == 401
    assert httpx.get(url + "/v1/config", headers=bearer(ENV_KEY)).status_code == 200
    assert httpx.get(url + "/healthz").status_code == 200


def test_the_bearer_scheme_is_read_in_any_case(keyed):
    _, url = keyed
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(url + "/v1/config", headers=bearer("gamma-key", scheme)).status_code == 200, scheme
    for headers in (
        bearer("gamma-key", "Basic"),
        bearer("gamma-ke"),
        bearer("gamma-keys"),
        {"Authorization": "gamma-key"},
        {},
    ):
        answer = httpx.get(url + "/v1/config", headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"


def test_a_keyed_server_answers_any_host_name(keyed):
    _, url = keyed
    headers = {**bearer("gamma-key"), "Host": "images.behind-a-proxy.example"}
    assert httpx.get(url + "/v1/config", headers=headers).status_code == 200
    assert httpx.get(url + "/v1/config", headers={"Host": "images.behind-a-proxy.example"}).status_code == 401


def test_a_keyed_servers_docs_open_without_the_key_and_try_it_out_sends_it(keyed):
    """/docs and its schema hold no data: a browser, which sends no key to open a page, loads them; the
    schema declares the Bearer key, which Swagger UI's Authorize button takes and each call then sends."""
    _, url = keyed
    assert httpx.get(url + "/docs").status_code == 200
    assert httpx.get(url + "/static/docs/swagger-ui-bundle.js").status_code == 200
    schema = httpx.get(url + "/openapi.json").json()
    assert schema["components"]["securitySchemes"]["api_key"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "an API key of this server",
    }
    assert schema["security"] == [{"api_key": []}] and schema["paths"]["/healthz"]["get"]["security"] == []
    # The models list, as every other /v1 route, needs the key.
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=bearer("gamma-key")).json()["object"] == "list"


def test_a_keyless_servers_schema_declares_no_key(serve_url):
    assert "security" not in httpx.get(serve_url + "/openapi.json").json()


def test_a_key_over_its_requests_a_minute_gets_429_with_retry_after(keyed):
    _, url = keyed
    answers = [httpx.get(url + "/v1/config", headers=bearer("alpha-key")) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    error = answers[2].json()["error"]
    assert error["code"] == "rate_limited" and "2 requests a minute" in error["message"]
    assert 1 <= int(answers[2].headers["Retry-After"]) <= 30
    assert "alpha-key" not in error["message"]  # the key is named by where it came from
    # Other keys keep their own (here: no) limit.
    assert all(
        httpx.get(url + "/v1/config", headers=bearer("gamma-key")).status_code == 200 for _ in range(4)
    )


def test_a_key_over_its_jobs_at_once_gets_429_until_one_finishes(keyed):
    _, url = keyed
    first = httpx.post(url + "/v1/jobs", json=LONGER, headers=bearer("beta-key"))
    assert first.status_code == 202, first.text
    second = httpx.post(url + "/v1/jobs", json=SHORT, headers=bearer("beta-key"))
    assert second.status_code == 429 and "1 job at once" in second.json()["error"]["message"]
    assert int(second.headers["Retry-After"]) >= 1
    # Another key is not held back by beta's job.
    other = httpx.post(url + "/v1/images/generations", json=SHORT, headers=bearer("gamma-key"), timeout=300)
    assert other.status_code == 200, other.text
    job = first.json()["id"]
    deadline = time.monotonic() + 300
    while job_status(url, job, bearer("beta-key")) != "done":
        assert time.monotonic() < deadline, "the first job did not finish"
        time.sleep(0.1)
    third = httpx.post(url + "/v1/images/generations", json=SHORT, headers=bearer("beta-key"), timeout=300)
    assert third.status_code == 200, third.text


def test_insecure_no_key_is_warned_of_at_start(keyless):
    process, _ = keyless
    assert "WARNING: --insecure-no-key" in log_of(process)


@pytest.mark.parametrize(
    "host", ["rebind.evil.example", "rebind.evil.example:{port}", "localhost.evil.example"]
)
def test_a_keyless_server_refuses_a_foreign_host(keyless, host):
    _, url = keyless
    headers = {"Host": host.format(port=url.rsplit(":", 1)[1])}
    for method, path in [("GET", "/"), ("GET", "/v1/config"), ("POST", "/v1/images/generations")]:
        answer = httpx.request(method, url + path, headers=headers, json=SHORT)
        assert answer.status_code == 403, (method, path, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "forbidden_host" and "--allowed-hosts" in error["message"]


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:{port}", "localhost:{port}", "LocalHost", "[::1]:{port}", "images.example", "127.0.0.2"],
)
def test_a_keyless_server_answers_loopback_names_and_allowed_hosts(keyless, host):
    _, url = keyless
    headers = {"Host": host.format(port=url.rsplit(":", 1)[1])}
    assert httpx.get(url + "/v1/config", headers=headers).status_code == 200


def test_a_foreign_origin_cannot_change_state(keyless):
    _, url = keyless
    for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example", "https://app.example.org"):
        headers = {"Origin": origin}
        for method, path in [
            ("POST", "/v1/jobs"),
            ("POST", "/v1/images/edits"),
            ("DELETE", "/v1/references/x"),
        ]:
            answer = httpx.request(method, url + path, headers=headers, json=SHORT)
            assert answer.status_code == 403, (origin, method, path)
            assert answer.json()["error"]["code"] == "forbidden_origin"
            assert "access-control-allow-origin" not in answer.headers
        # Reading is left to the browser's same-origin rule: no CORS header lets the page see the answer.
        read = httpx.get(url + "/v1/config", headers=headers)
        assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
    own = httpx.post(url + "/v1/jobs", json=SHORT, headers={"Origin": url})
    assert own.status_code == 202, own.text
    assert httpx.post(url + "/v1/jobs", json=SHORT).status_code == 202  # no Origin: not a browser


def test_an_allowed_origin_gets_cors(keyless):
    _, url = keyless
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    asked["Access-Control-Request-Headers"] = "authorization, content-type"
    preflight = httpx.options(url + "/v1/jobs", headers=asked)
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "Authorization" in preflight.headers["access-control-allow-headers"]
    assert "POST" in preflight.headers["access-control-allow-methods"]
    posted = httpx.post(url + "/v1/jobs", json=SHORT, headers={"Origin": "https://app.example"})
    assert (
        posted.status_code == 202 and posted.headers["access-control-allow-origin"] == "https://app.example"
    )
    foreign = httpx.options(url + "/v1/jobs", headers={**asked, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in foreign.headers


def test_a_json_body_is_capped_at_1_mib_below_a_larger_upload_cap(keyless):
    _, url = keyless  # --max-upload-bytes: 50 MiB, the default
    body = b'{"prompt": "' + b"a" * 2**20 + b'"}'
    declared = httpx.post(url + "/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413 and "1048576 bytes" in declared.json()["error"]["message"]
    status, answer = chunked(url, "/v1/jobs", b"application/json", b'{"prompt": "', b"a")
    assert status == 413 and b"1048576 bytes" in answer


def test_no_cors_headers_unless_configured(serve_url):
    asked = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(serve_url + "/v1/jobs", headers=asked).headers


# The rules in-process.


def test_key_lines_read_limits_and_refuse_what_is_not_one():
    assert parse_key_line("k1 rpm=60 jobs=2", "x") == ApiKey("k1", "x", rpm=60, jobs=2)
    assert parse_key_line("  k2  ", "x") == ApiKey("k2", "x")
    assert parse_key_line("k3 operator rpm=5", "x") == ApiKey("k3", "x", rpm=5, operator=True)
    for line in (
        "k rps=5",
        "k rpm=0",
        "k rpm=5 rpm=6",
        "k jobs=two",
        "k operator operator",
        "k admin",
        "   ",
    ):
        with pytest.raises(InputError, match="rpm=N|empty|operator"):
            parse_key_line(line, "keys.txt line 3")


def test_keys_come_from_the_flag_the_environment_and_the_file(tmp_path):
    file = tmp_path / "keys.txt"
    file.write_text("# comment\nf1 jobs=1\n\nf2\n")
    keys = read_keys("flag-key", str(file), {"KLEIN_API_KEY": "env-key rpm=9"})
    assert [(k.secret, k.label, k.rpm, k.jobs) for k in keys] == [
        ("flag-key", "--api-key", None, None),
        ("env-key", "KLEIN_API_KEY", 9, None),
        ("f1", "--api-key-file line 2", None, 1),
        ("f2", "--api-key-file line 4", None, None),
    ]
    assert "secret" not in repr(keys[0]) and "flag-key" not in repr(keys[0])
    with pytest.raises(InputError, match="twice"):
        read_keys("f1", str(file), {})
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(InputError, match="no key"):
        read_keys(None, str(tmp_path / "empty.txt"), {})


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--api-key-file", "/nonexistent/keys.txt"], "cannot read it"),
        (["--allowed-origins", "app.example"], "is not an origin"),
        (["--allowed-hosts", "http://images.example"], "is not a host name"),
    ],
)
def test_bad_access_flags_exit_2_with_one_line(capsys, argv, words):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_exposure_needs_a_key_or_the_insecure_flag():
    key = (ApiKey("k", "x"),)
    assert (
        exposure_warning("127.0.0.1", (), False) is None and exposure_warning("localhost", (), False) is None
    )
    assert exposure_warning("0.0.0.0", key, False) is None
    with pytest.raises(InputError, match="--insecure-no-key"):
        exposure_warning("0.0.0.0", (), False)
    assert "WARNING" in exposure_warning("0.0.0.0", (), True)
    assert "WARNING" in exposure_warning("127.0.0.1", (), True)  # the flag is warned of wherever it is given


def test_host_and_origin_rules():
    access = Access(
        host="127.0.0.1", allowed_hosts=("images.example",), allowed_origins=("https://app.example",)
    )
    for host in ("127.0.0.1:8000", "localhost", "[::1]:1", "images.example:443", None):
        assert access.host_allowed(host), host
    for host in ("evil.example", "127.0.0.1.evil.example", "10.0.0.5:8000", "[::1", ""):
        assert not access.host_allowed(host), host
    assert Access(host="0.0.0.0").host_allowed("10.0.0.5:8000")  # any address of the machine, never a name
    assert not Access(host="0.0.0.0").host_allowed("evil.example:8000")
    assert access.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert access.origin_allowed("https://app.example", "127.0.0.1:8000")
    assert not access.origin_allowed("http://evil.example", "127.0.0.1:8000")
    assert not access.origin_allowed(
        "http://localhost:8000", "127.0.0.1:8000"
    )  # another origin, as browsers say
    assert access.cors("https://app.example")["Access-Control-Allow-Origin"] == "https://app.example"
    assert access.cors("http://evil.example") == {} and access.cors(None) == {}


def test_the_request_bucket_refills_at_its_rate_and_job_slots_come_back_once():
    now = [0.0]
    quotas = Quotas(clock=lambda: now[0])
    key = ApiKey("k", "test", rpm=2, jobs=1)
    quotas.request(key)
    quotas.request(key)
    with pytest.raises(ApiError) as refused:
        quotas.request(key)
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "30"
    now[0] = 30.0
    quotas.request(key)  # one token back after half a minute
    release = quotas.job(key)
    with pytest.raises(ApiError, match="1 job at once"):
        quotas.job(key)
    release()
    release()  # twice gives back one slot, not two
    quotas.job(key)
    with pytest.raises(ApiError):
        quotas.job(key)
    quotas.job(None)()  # no key, no limit


def test_an_eps_upload_never_reaches_ghostscript(monkeypatch):
    calls = []

    def ghostscript(*args, **kwargs):
        calls.append(args)
        raise OSError("Ghostscript would run here")

    monkeypatch.setattr(PIL.EpsImagePlugin, "Ghostscript", ghostscript)
    with pytest.raises(InputError, match="not a PNG, JPEG or WEBP image"):
        images.read_image(EPS, "image 1", formats=images.UPLOAD_FORMATS)
    assert calls == []
    # Without the formats, Pillow's EPS plugin takes the file and runs Ghostscript on it.
    with pytest.raises(InputError):
        images.read_image(EPS, "image 1")
    assert len(calls) == 1
