"""Client-controlled text in log lines and error messages.

A request path, a ``vllm_xargs`` key or value, a name a client sent: any of them may hold line
breaks, carriage returns, terminal escapes or megabytes. Logged or echoed as they are,
``POST /x%0A<line>`` writes a forged line into the server's log (and escapes into a reader's
terminal). ``printable`` renders such text as one bounded line; nothing the plugin logs or
answers carries a client's text otherwise.
"""

from __future__ import annotations

LIMIT = 200  # characters of the client's text kept (before escaping)


def printable(value, limit: int = LIMIT) -> str:
    """``value`` (a string as it is, anything else as its ``repr``) cut to its first ``limit``
    characters ("..." after when cut), then with every control or non-printable character and
    every backslash escaped as Python writes them in a literal (``\\n``, ``\\x1b``, ``\\u2028``,
    ``\\\\``), without the quotes: one line of at most ``10 * limit + 3`` characters, which no
    client can make look like another line, another field or another log record."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:limit])[1:-1] + ("..." if len(text) > limit else "")
