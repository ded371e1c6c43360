"""The report's HTML building blocks: escaping, number formatting, tables, embedded images,
section headings and the page's style. Everything a run directory holds is escaped here, once."""

from __future__ import annotations

import base64
import html
from typing import Any

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:70em;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0} td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left;vertical-align:top} th{background:#f3f3f3} code{font-size:.9em;word-break:break-all}
.decision{display:inline-block;padding:.4em 1em;font-size:1.4em;font-weight:bold;color:#fff;
border-radius:.3em} .accept{background:#2e7d32} .tune{background:#ef6c00} .reject{background:#c62828}
.pass{color:#2e7d32;font-weight:bold} .fail{color:#c62828;font-weight:bold} .note{color:#555}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
pre{white-space:pre-wrap;margin:0;max-height:12em;overflow:auto;font-size:.85em}
h4{margin:.8em 0 .2em}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, unit: str = "") -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)) and unit == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escape values with _e / _fmt before passing them)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# --- sections ---------------------------------------------------------------------------------

# One line per gate: what to try when it fails (the gate names of evidence/decisions.py).
def _img(pngs: dict[str, bytes], name: str, alt: str) -> str:
    data = base64.b64encode(pngs[name]).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_e(alt)}">'


def _h2(section: str, title: str) -> str:
    return f'<h2 id="{section}">{title}</h2>'
