"""The one error type a user sees: a single clear line, never a traceback."""

import re
import sys
from typing import Callable


class UserError(Exception):
    """Bad input or an environment problem the user can fix; the CLI prints ``error: <message>``.

    :param message: one line that says what is wrong and, where possible, what to do
    :param exit_code: the process exit status (2 for bad arguments, 1 for "cannot proceed")
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


# a value quoted in an error longer than this is cut: a 5,000-character --run or multiaddr filled a terminal; an
# unquoted word (click's "No such option: --...") only when longer than a path is likely to be
MAX_QUOTED_CHARS, MAX_WORD_CHARS = 120, 300
# a quote opens after no letter and closes before none: the apostrophe of "model lossy's loss" is no quote
QUOTED_RE = re.compile(r"(?<!\w)'([^'\n]{%d,})'(?!\w)" % (MAX_QUOTED_CHARS + 1))
WORD_RE = re.compile(r"(\S{%d,})" % (MAX_WORD_CHARS + 1))


def error_line(message: str) -> str:
    """``message`` as the one line a user reads: a quoted value over :data:`MAX_QUOTED_CHARS` characters (a word
    over :data:`MAX_WORD_CHARS`) shown by its start, end and length, and line breaks (a name or path with one in
    it) written as ``\\n``."""
    def shortened(quote: str) -> Callable[[re.Match], str]:
        return lambda match: (f"{quote}{match.group(1)[:80]}...{match.group(1)[-20:]}{quote} "
                              f"({len(match.group(1))} characters)")

    message = WORD_RE.sub(shortened(""), QUOTED_RE.sub(shortened("'"), message))
    return message.replace("\r", "\\r").replace("\n", "\\n")


def print_error(message: str) -> None:
    """``error: message`` on stderr, as the one line :func:`error_line` makes of it."""
    print(error_line(f"error: {message}"), file=sys.stderr, flush=True)
