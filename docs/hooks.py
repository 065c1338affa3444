"""mkdocs hook: the docstrings' Sphinx roles (:class:`~a.b.C`) render as code (``C``), not as literal role text."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")


def _as_code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"  # ~a.b.C shows as C, as in Sphinx


def on_page_content(html: str, **kwargs: object) -> str:
    """Rewrites every ``:role:<code>target</code>`` left in a page's HTML."""
    return _ROLE.sub(_as_code, html)
