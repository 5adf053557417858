"""This process's /proc/self/status fields: its memory (the host budget, the RSS log) and its
umask (saved files' modes), read in one place."""

from __future__ import annotations


def status_field(name: str) -> str | None:
    """The value of field ``name`` of /proc/self/status (``VmRSS``, ``Umask``, ...): its first
    word; None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{name}:"):
                    words = line.split()
                    return words[1] if len(words) > 1 else None
    except OSError:
        pass
    return None
