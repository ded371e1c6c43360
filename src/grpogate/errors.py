"""Errors the user can act on, and how any text from a file reaches the terminal.

`InputError` is raised for anything wrong with what the user handed us (files, fields,
configuration). The CLI prints its message on one line and exits with code 2, before anything
is written into the output directory.

`plain(value)` is the one way a string that came from a file (a run directory's evidence,
manifest or records, an eval file, a config, an error message quoting any of them) is printed:
as text. Rich markup in it is escaped (`[link=...]`, `[green]`, `[/oops]` print as typed), and
control characters (ESC, the rest of C0 and C1, DEL), bidi overrides, line separators and lone
surrogates print as visible escapes, so no file can clear the screen, set the title, reorder
a line, fake a line of our own or crash the console's encoder. `command(...)` is a command
line printed for the user to copy: each word shell-quoted, then `plain`. `visible(value)` is
`plain` for a stream that is not a rich console (no markup to escape).
"""

import re
import shlex

from rich.markup import escape

_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                        "\u2066-\u2069\ud800-\udfff]")


class InputError(ValueError):
    """Bad user input: the message names the file, line and field where it can."""


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(value) -> str:
    """`value` as text for a plain stream (stderr, a log): "\\x1b[2J" for ESC [2J."""
    return _INVISIBLE.sub(_visible, str(value))


def plain(value) -> str:
    """`value` as text for a rich console: "\\x1b[2J" for ESC [2J, "\\[/oops]" for [/oops]."""
    return escape(visible(value))


def command(*words) -> str:
    """A command for the user to copy, as text: every word shell-quoted (a run directory named
    `$(id)` pastes as a name, not as a command substitution), then `plain`."""
    return plain(shlex.join(str(word) for word in words))


def first_line(error: Exception) -> str:
    """An error's first line of text, or its type's name when it has none: for a one-line
    `error:` message built around a library's multi-line exception."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
