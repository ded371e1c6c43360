"""What an untrusted JSON text holds before it is parsed: its nesting depth and its longest
string, found by one linear scan that allocates nothing per character.

The scan walks the text's tokens with one compiled pattern: a whole string (quotes and escapes
included), an opening or closing bracket outside strings, or a quote that opens a string never
closed. The string alternative is written with possessive quantifiers (`*+`, Python >= 3.11,
which grpogate needs for tomllib anyway): the regex engine keeps no backtracking state per
repetition, so matching a string of any length costs O(1) memory. (A plain alternation,
`"(?:[^"\\]|\\.)*"`, keeps some 120 bytes per character: a 200 MB string took 24 GB.) Each
match object refers to the text and holds two offsets; Python's loop runs once per string and
bracket, never per character, and only on a text that could fail a bound (more opening
brackets than the depth limit, or longer than the string limit): other texts cost two
`str.count` calls and nothing else.

`compact_text` decodes a file's UTF-8 bytes into the narrowest text json.loads can read. Python
holds a text at the width of its widest character, so one character above U+FFFF makes every
character of a decoded file cost 4 bytes (a 17 MB file of ASCII with one emoji: 68 MB of text).
Where that costs more than writing its non-ASCII characters as JSON escapes (6 characters,
12 for one above U+FFFF, all ASCII), the text is built escaped: json.loads reads the same
values, and a character outside a string is as invalid escaped as raw.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The longest JSON string grpogate reads, in characters of the file's text between its quotes
# (escapes counted as written: json.dumps writes a non-ASCII character as \uXXXX, 6
# characters, or 12 for a pair). The longest string a run writes is a completion or a
# problem's text: 32,768 tokens (a long-reasoning budget, 680x the default 48) of up to 128
# characters each is 4,194,304 = 4 MiB. Every other field (ids, versions, settings, paths,
# messages) is under a kilobyte.
MAX_JSON_STRING_CHARS = 1 << 22

_TOKEN = re.compile(r'("[^"\\]*+(?:\\.[^"\\]*+)*+")|([\[{])|([\]}])|(")', re.S)
_KEY_SEPARATOR = re.compile(r"\s*:\s*")
STRING, OPEN, CLOSE = 1, 2, 3
SHOWN_KEY_CHARS = 80  # a key longer than this is shown cut (it names the field, no more)


@dataclass(frozen=True)
class TextBounds:
    """What `scan` found: whether the nesting passes `depth_limit` and the first string longer
    than the string limit (None when there is none): its length, offset and object key."""

    too_deep: bool = False
    long_string: tuple[int, int, str | None] | None = None


def _key_before(text: str, start: int, previous: re.Match | None) -> str | None:
    """The object key of the string value at `start`: the string token just before it, when
    only a colon (and whitespace) lies between them; None for an array element or top level."""
    if previous is None or _KEY_SEPARATOR.fullmatch(text, previous.end(), start) is None:
        return None
    key = text[previous.start() + 1:previous.end() - 1]
    return key if len(key) <= SHOWN_KEY_CHARS else key[:SHOWN_KEY_CHARS] + "..."


def scan(text: str, depth_limit: int, string_limit: int = MAX_JSON_STRING_CHARS) -> TextBounds:
    """Whether `text` nests brackets deeper than `depth_limit` outside strings, and its first
    string longer than `string_limit` characters. Linear time, O(1) extra memory. A string
    never closed ends the scan: the text is malformed, and json.loads says where (it reads no
    bracket after that quote, so no nesting past it can reach its recursion)."""
    openings = text.count("[") + text.count("{")
    if openings <= depth_limit and len(text) <= string_limit + 2:
        return TextBounds()
    depth, previous_string = 0, None
    for match in _TOKEN.finditer(text):
        kind = match.lastindex
        if kind == STRING:
            length = match.end() - match.start() - 2
            if length > string_limit:
                key = _key_before(text, match.start(), previous_string)
                return TextBounds(long_string=(length, match.start(), key))
            previous_string = match
        elif kind == OPEN:
            depth += 1
            if depth > depth_limit:
                return TextBounds(too_deep=True)
        elif kind == CLOSE:
            depth -= 1
        else:
            break
    return TextBounds()


_NON_ASCII_RUN = re.compile(rb"[\x80-\xff]+")
_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
_NON_ASCII_BYTES = bytes(range(0x80, 0x100))
_WIDE_LEAD = re.compile(rb"[\xc4-\xf4]")  # starts a character above U+00FF
_ASTRAL_LEADS = [bytes([lead]) for lead in range(0xF0, 0xF5)]  # a character above U+FFFF
# A backslash before a non-ASCII character is an invalid escape in JSON; written as \\uXXXX
# it would read as a valid escaped backslash, so such a text is decoded as it is.
_ESCAPED_NON_ASCII = re.compile(rb"\\[\x80-\xff]")
_MARKS = bytes.maketrans(bytes(range(256)), b"a" * 128 + b"b" * 128)  # ASCII -> a, other -> b
BYTES_PER_RUN = 16  # escaping takes at most one run of non-ASCII bytes per 16 bytes (its time)


def _escaped(run: re.Match) -> bytes:
    """One run of non-ASCII bytes -> its characters as JSON escapes (UnicodeDecodeError, its
    position in the whole text, when the run is not UTF-8)."""
    try:
        characters = run.group().decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnicodeDecodeError("utf-8", run.string, run.start() + error.start,
                                 run.start() + error.end, error.reason) from None
    return json.dumps(characters)[1:-1].encode("ascii")


def compact_text(data: bytes) -> str:
    """UTF-8 `data` (a JSON text) as str, never held in more memory than decoding it as it is
    would take: decoded as it is where Python holds that in 1 byte a character (ASCII,
    Latin-1) or where escaping costs no less; otherwise (a mostly-ASCII text with a few
    characters above U+00FF, in at most one run per BYTES_PER_RUN bytes, and no backslash
    before a non-ASCII character) with its non-ASCII characters as JSON escapes, written into
    one buffer of the escaped text's exact length. UnicodeDecodeError as bytes.decode raises
    it (its position counted in `data`)."""
    if data.isascii() or _WIDE_LEAD.search(data) is None:
        return data.decode("utf-8")
    characters = len(data.translate(None, _CONTINUATION_BYTES))
    ascii_characters = len(data.translate(None, _NON_ASCII_BYTES))
    astral = sum(data.count(lead) for lead in _ASTRAL_LEADS)
    decoded = characters * (4 if astral else 2)
    escaped = ascii_characters + 6 * (characters - ascii_characters) + 6 * astral
    runs = data.translate(_MARKS).count(b"ab") + (data[0] >= 0x80)
    # Escaping holds the buffer and its text at once (2 x escaped); decoding as it is holds the
    # text and then, beside it, the values, about a byte a character.
    if (2 * escaped >= decoded + characters or runs * BYTES_PER_RUN > len(data)
            or _ESCAPED_NON_ASCII.search(data)):
        return data.decode("utf-8")
    out, at, end, view = bytearray(escaped), 0, 0, memoryview(data)
    for run in _NON_ASCII_RUN.finditer(data):
        out[at:at + run.start() - end] = view[end:run.start()]
        at += run.start() - end
        text = _escaped(run)
        out[at:at + len(text)] = text
        at, end = at + len(text), run.end()
    out[at:] = view[end:]
    return out.decode("ascii")
