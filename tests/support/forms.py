"""Test-side forcing of a kernel form the dispatch picks by shape, so that every form of an
op runs at the small shapes the tests afford (the product has no switch for it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from kernels import mhc


@contextlib.contextmanager
def mhc_finish_form(form: str, seen: list[str] | None = None) -> Iterator[None]:
    """``kernels.mhc`` calls in this block take ``form``: "fused" / "tile" where the one-tile
    finish fits (a decode wave; "loop" elsewhere), "loop" everywhere, "auto" the dispatch's
    own choice. ``seen`` receives the form of each call."""
    real = mhc._finish_form

    def forced(t: int, n: int, d: int, sms: int) -> str:
        got = real(t, n, d, sms)
        if form == "loop" or (form != "auto" and got != "loop"):
            got = form
        if seen is not None:
            seen.append(got)
        return got

    with mock.patch.object(mhc, "_finish_form", forced):
        yield
