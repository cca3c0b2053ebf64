"""docs/reference.md is what scripts/gen_reference.py writes from the docstrings of specplug.heads and
specplug.train: a docstring changed without the page fails here (regenerate the page)."""
from __future__ import annotations

from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    return load_script("gen_reference")


def test_the_reference_page_is_current():
    gen = _generator()
    assert gen.PAGE.read_text() == gen.render(), \
        "docs/reference.md is stale: run .venv/bin/python scripts/gen_reference.py and commit the page"


def test_the_page_covers_every_export_of_specplug_heads_and_the_seams_authors_asked_for():
    import specplug.heads

    page = (ROOT / "docs" / "reference.md").read_text()
    for name in specplug.heads.__all__:
        assert f"### `{name}" in page, name
    for piece in ("SequentialHeadsDrafter", "advance(depth: int, carry", "output_norm() -> torch.Tensor",
                  "draft_vocab(tokens", "linear(name: str, backend", "The contract of `advance(depth, rows"):
        assert piece in page, piece


def test_a_changed_docstring_makes_the_page_stale(monkeypatch):
    from specplug.heads import DraftLoop

    gen = _generator()
    assert gen.main(["--check"]) == 0
    monkeypatch.setattr(DraftLoop.pick, "__doc__", "changed")
    assert gen.main(["--check"]) == 1
