"""The argument parser of every `klein` command, light to import: `klein --version` and `klein --help` parse
with it alone, before any command's modules (and JAX) load."""

import argparse
import difflib
import re

from klein.errors import InputError


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes surface as `error: ...` through `main`, like every other input error,
    with the nearest known flag for a misspelt one; descriptions are shown as written."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            message += self.hint(unknown.group(1).split("=")[0])
        raise InputError(f"{message} (see {self.prog} --help)")

    def hint(self, word: str) -> str:
        """What to say of the unknown flag `word`: the nearest known one, if any is near."""
        close = difflib.get_close_matches(word, list(self._option_string_actions), n=1, cutoff=0.6)
        return f"; did you mean {close[0]}?" if close else ""
