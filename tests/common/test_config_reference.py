from __future__ import annotations

from pathlib import Path

from gpulet_common.config_reference import markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_current() -> None:
    assert DOCS.read_text() == markdown(), (
        "regenerate with: gpulet config reference > docs/config.md"
    )


def test_every_setting_is_described() -> None:
    undescribed = [
        line.split("|")[1].strip() for line in markdown().splitlines() if line.endswith("|  |")
    ]
    assert undescribed == []
