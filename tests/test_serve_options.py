"""`klein serve`'s options: SIZE text, and bad flags refused as one error line (exit 2) before loading, a
port in use among them."""

import socket

import pytest

from klein.cli import main as cli
from klein.errors import InputError
from klein.request.kinds import parse_size
from klein.serve.options import ServeOptions


@pytest.mark.parametrize(
    ("text", "size"),
    [("4096", 4096), ("512KiB", 512 * 2**10), ("64 MiB", 64 * 2**20), ("2GiB", 2 * 2**30), ("1.5k", 1536)],
)
def test_sizes_read_bytes_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "12XB", "-5", "1e9"])
def test_a_size_that_is_not_one_is_an_input_error(text):
    with pytest.raises(InputError, match="KiB/MiB/GiB"):
        parse_size(text)


def test_limits_must_be_positive():
    with pytest.raises(InputError, match="--max-queue must be a positive number"):
        ServeOptions(max_queue=0)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--cache-bytes", "lots"], "'lots' is not a size"),
        (["--max-queue", "0"], "--max-queue must be a positive number"),
        (["--job-timeout", "0"], "--job-timeout must be a positive number"),
        (["--result-ttl", "soon"], "invalid float value"),
        (["--max-result-bytes", "lots"], "'lots' is not a size"),
        (["--port", "http"], "invalid int value"),
        (["--min-body-rate", "0"], "--min-body-rate must be a positive number"),
        (["--header-timeout", "soon"], "invalid float value"),
        (
            ["--upload-budget-bytes", "1MiB"],
            "--upload-budget-bytes (1MiB) must be at least --max-upload-bytes",
        ),
    ],
)
def test_bad_serve_flags_exit_2_with_one_line(capsys, argv, words):
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_a_port_in_use_is_refused_before_anything_loads(capsys, klein_home, monkeypatch):
    monkeypatch.setenv("KLEIN_HOME", str(klein_home))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--no-warm"]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}: port {port} is in use" in err, err
    assert "stop that server, or pass --port with a free port" in err
    assert "loading" not in err and err.count("\n") == 1  # said before the weights load


@pytest.mark.parametrize(
    ("port", "words"), [("70000", "give a port from 1 to 65535"), ("-1", "from 1 to 65535")]
)
def test_a_port_out_of_range_is_refused(capsys, port, words):
    assert cli.main(["serve", "--port", port]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
