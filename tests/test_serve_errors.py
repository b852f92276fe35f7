"""Bad requests to `klein serve`: each a 4xx with OpenAI's JSON error naming the problem, the server
healthy after each (the shared server of `serve_url`: limits 3 references, 1 MP, 1 MiB, 64 MiB)."""

import io
import socket
from urllib.parse import urlsplit

import httpx
import numpy as np
import PIL.Image
import pytest

from tests.support.serve_process import png

GOOD = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 2}


def generations(**changes):
    body = {**GOOD, **changes}
    return lambda url: httpx.post(
        url + "/v1/images/generations", json={k: v for k, v in body.items() if v != ...}
    )


def job(**changes):
    return lambda url: httpx.post(url + "/v1/jobs", json={**GOOD, **changes})


def edits(images, **fields):
    data = {"prompt": "a fox", "num_inference_steps": "2", **fields}
    return lambda url: httpx.post(url + "/v1/images/edits", data=data, files=[("image[]", i) for i in images])


def truncated_png() -> bytes:
    return png(1)[:300]


def bomb_png(side: int = 3000) -> bytes:
    """A small file whose header says side x side pixels (zeros compress a thousandfold)."""
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.zeros((side, side), np.uint8)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def chunked_upload(url: str) -> tuple[int, bytes]:
    """A multipart body streamed in chunks without Content-Length, larger than the 1 MiB cap: the status
    and body the server answers with, having read at most a little more than the cap."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/references HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: multipart/form-data; boundary=B\r\n\r\n"
        )
        head = b'--B\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        chunk = head + b"\0" * 65536
        try:
            for _ in range(40):  # 2.5 MiB offered
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                chunk = b"\0" * 65536
        except OSError:
            pass  # the server answered and closed while we were still sending: what we want
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    status = int(reply.split(b" ", 2)[1])
    return status, reply.split(b"\r\n\r\n", 1)[1]


CASES = [
    ("missing prompt", generations(prompt=...), 400, "prompt"),
    ("prompt not a string", generations(prompt=42), 400, "prompt"),
    ("n as a string", generations(n="2"), 400, "n"),
    ("n zero", generations(n=0), 400, "n"),
    ("n above the limit", generations(n=11), 400, "n"),
    ("size not WxH", generations(size="big"), 400, "size"),
    ("size under 16 px", generations(size="8x64"), 400, "size"),
    ("size over max pixels", generations(size="2048x2048"), 400, "size"),
    ("steps zero", generations(num_inference_steps=0), 400, "num_inference_steps"),
    ("steps above the limit", generations(num_inference_steps=51), 400, "num_inference_steps"),
    ("negative seed", generations(seed=-1), 400, "seed"),
    ("guidance not a number", generations(guidance_scale="high"), 400, "guidance_scale"),
    ("url response format", generations(response_format="url"), 400, "response_format"),
    ("unknown reference id", generations(references="0123abcd"), 404, "references"),
    ("cannot fit", generations(size="1024x960", n=10), 422, None),
    ("body not JSON", lambda url: httpx.post(url + "/v1/images/generations", content=b"{nope"), 400, None),
    ("edit without images", edits([]), 400, "image"),
    ("too many references", edits([png(i) for i in range(4)]), 400, "image"),
    ("not an image", edits([b"GIF89a but not really"]), 400, "image"),
    ("truncated image", edits([truncated_png()]), 400, "image"),
    ("image too small", edits([png(1, 32, 32)]), 400, "image"),
    ("image too elongated", edits([png(1, 64, 600)]), 400, "image"),
    ("decompression bomb", edits([bomb_png()]), 400, "image"),
    ("seed form field not a number", edits([png(1)], seed="abc"), 400, "seed"),
    ("images and a reference id", edits([png(1)], references="0123abcd"), 400, "references"),
    (
        "unexpected file field",
        lambda url: httpx.post(url + "/v1/references", files=[("mask", png(1))]),
        400,
        "mask",
    ),
    (
        "upload over the cap",
        lambda url: httpx.post(url + "/v1/references", files=[("image", bytes(2**21))]),
        413,
        None,
    ),
    ("unknown reference to get", lambda url: httpx.get(url + "/v1/references/nope"), 404, "id"),
    ("unknown reference to delete", lambda url: httpx.delete(url + "/v1/references/nope"), 404, "id"),
    ("unknown job", lambda url: httpx.get(url + "/v1/jobs/nope"), 404, "id"),
    ("job with a bad body", lambda url: httpx.post(url + "/v1/jobs", json={"prompt": ""}), 400, "prompt"),
    ("job that cannot fit", job(size="1024x960", n=10), 422, None),
    ("job with an unknown reference id", job(references="0123abcd"), 404, "references"),
    ("unknown route", lambda url: httpx.get(url + "/v1/nothing"), 404, None),
]


@pytest.mark.parametrize(("send", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_a_4xx_json_error_and_the_server_stays_healthy(serve_url, send, status, param):
    response = send(serve_url)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error" and error["code"]
    assert len(error["message"]) > 20
    assert httpx.get(serve_url + "/healthz").status_code == 200


def test_cannot_fit_says_the_estimate(serve_url):
    error = generations(size="1024x960", n=10)(serve_url).json()["error"]
    assert error["code"] == "cannot_fit" and "GiB" in error["message"] and "64.0 MiB" in error["message"]


def test_an_upload_streamed_past_the_cap_is_refused_before_it_is_read(serve_url):
    status, body = chunked_upload(serve_url)
    assert status == 413 and b"upload_too_large" in body
    assert httpx.get(serve_url + "/healthz").status_code == 200


def test_bombs_are_refused_from_their_headers(serve_url):
    # Over --max-pixels: klein's header check; over twice that: PIL's own guard, set from --max-pixels.
    for side, words in ((1200, "1200x1200 px, more than the 1000000"), (3000, "9000000 pixels")):
        bomb = bomb_png(side)
        assert len(bomb) < 64 * 1024  # well under the upload cap: the pixel count is what refuses it
        error = edits([bomb])(serve_url).json()["error"]
        assert words in error["message"] and error["code"] == "invalid_image"
