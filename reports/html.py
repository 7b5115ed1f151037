"""The HTML both reports write: one stylesheet, one table, one rule for escaping.

Every cell and text is escaped unless it is `Html`, markup these helpers (or a caller, from
escaped parts) built; so a member name, a program or a path from a run directory can never
inject markup into a report."""

from __future__ import annotations

import html

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1250px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.95em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: left; }
th { background: #f2f2f2; } tr:nth-child(even) td { background: #fafafa; }
.yes { color: #0a6b1f; font-weight: 600; } .no { color: #666; }
figure { margin: 1.5em 0; } figcaption { color: #555; max-width: 60em; }
img { max-width: 100%; border: 1px solid #eee; } pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
"""


class Html(str):
    """Text that is already HTML: not escaped again."""


def escape(value: object) -> Html:
    return value if isinstance(value, Html) else Html(html.escape(str(value)))


def table(header: list[object], rows: list[list[object]]) -> Html:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return Html(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


def head(title: str) -> Html:
    """The page's start, up to and with the opening body tag."""
    return Html(f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
                f"<style>{CSS}</style></head><body>")
