"""Text made safe for a terminal: what ``sfhpc traj`` prints (and every error line of the CLI) goes through
`printable`.

Trajectory text is what a model wrote and what agents sent (observations, tool output), and trajectory ids,
task and group names may be chosen by an agent's client: any of it may hold terminal control sequences (an
ANSI escape that recolours, moves the cursor, rewrites the window title or the clipboard; a carriage return
that writes over the line before it). Printed as they are, they act on the reader's terminal. `printable`
writes every control character (C0, DEL, C1) as a visible escape (``\\x1b``), except the ones the layout wants
(by default a newline and a tab), so the text shows what was recorded and does nothing else.
"""

from __future__ import annotations

_CONTROLS = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
_TABLES: dict[str, dict[int, str]] = {}


def printable(text: object, *, keep: str = "\n\t") -> str:
    """`text` (any object, as ``str``) with every control character but those in `keep` written as an escape:
    ``\\x1b`` for ESC, ``\\r`` for a carriage return. With ``keep=""`` the result is one line."""
    table = _TABLES.get(keep)
    if table is None:
        named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
        table = _TABLES[keep] = {c: named.get(c, f"\\x{c:02x}") for c in _CONTROLS if chr(c) not in keep}
    return str(text).translate(table)


def one_line(text: object) -> str:
    """`printable` for a field of a line (an id, a name, a table cell): no control character is kept."""
    return printable(text, keep="")
