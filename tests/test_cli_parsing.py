"""`klein`'s parsing: quick (no JAX before a command runs), a bare `klein`, and --prompt @FILE."""

import subprocess
import sys

import pytest

from klein.cli import flags as cli_args
from klein.cli import main as cli
from klein.errors import InputError
from tests.test_cli import run_klein

TOP_LEVEL = ("jax", "flax", "ml_dtypes", "numpy", "PIL", "tqdm")
"""The imports that took seconds of `klein --version` (JAX, ml_dtypes's bfloat16) or a little of it."""


@pytest.mark.parametrize(
    "args, unwanted",
    [
        (["--version"], TOP_LEVEL),
        (["--help"], TOP_LEVEL),
        (["generate", "--help"], ("jax", "flax", "ml_dtypes")),  # its flags come from the request types
    ],
)
def test_help_and_version_import_no_jax(args, unwanted):
    """`klein --version` and `klein --help` parse before any command's modules load; `klein generate
    --help` reads its flags off the request types, which need no model (nor JAX, nor ml_dtypes)."""
    code = f"""
import sys
from klein.cli.main import main
try:
    main({args!r})
except SystemExit as exit:
    assert exit.code == 0, exit.code
print("imported:", sorted(name for name in {unwanted!r} if name in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "klein" in done.stdout and done.stdout.splitlines()[-1] == "imported: []", done.stdout


def test_a_bare_klein_shows_the_commands_and_exits_2(klein_home, tmp_path):
    result = run_klein(klein_home, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert (
        "usage: klein" in result.stderr and "generate" in result.stderr and "Traceback" not in result.stderr
    )


def test_a_prompt_at_file_is_the_files_text_and_at_at_is_a_literal_at(tmp_path, monkeypatch):
    def prompt(*args):
        parsed = cli.generate_parser().parse_intermixed_args(list(args))
        return cli_args.build_request(parsed).generation.prompt

    (tmp_path / "fox.txt").write_text("a red fox\nin snow\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert prompt("--prompt", "@fox.txt") == "a red fox\nin snow" == prompt("prompt=@fox.txt")
    assert prompt("--prompt", f"@{tmp_path / 'fox.txt'}") == "a red fox\nin snow"
    assert prompt("--prompt", "@@home at noon") == "@home at noon"
    assert prompt("--prompt", "a fox @ noon") == "a fox @ noon"
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(InputError, match="empty.txt is empty"):
        prompt("--prompt", "@empty.txt")
    assert "@@ writes a literal leading @" in " ".join(cli.generate_parser().format_help().split())
