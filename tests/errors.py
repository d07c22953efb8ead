"""Checking the project's typed errors: the kind, what the message names, and a HINT that says what to do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def refused(kind: type[Exception], *words: str, call: Callable[[], Any]) -> str:
    """``call()`` raises ``kind`` with a HINT and every one of ``words`` in its message; the message."""
    with pytest.raises(kind) as info:
        call()
    text = str(info.value)
    assert "HINT" in text, text
    for word in words:
        assert word in text, (word, text)
    return text


__all__ = ["refused"]
