"""Process titles, so `ps` and `top` show each process's role (redserve-api, redserve-engine-0, ...)."""

from __future__ import annotations


def set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
