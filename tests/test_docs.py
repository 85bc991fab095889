"""The documentation site builds with no warning (``mkdocs build --strict``), and every command's help
shows the ``--config.FIELD=VALUE`` override syntax the docs use everywhere."""

from __future__ import annotations

import logging
import os

import pytest

from tieflax.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_site_builds_in_strict_mode(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mkdocs", reason="the test extra (mkdocs) is not installed")
    from mkdocs.commands.build import build  # noqa: PLC0415
    from mkdocs.config import load_config  # noqa: PLC0415
    from mkdocs.exceptions import Abort  # noqa: PLC0415

    monkeypatch.chdir(REPO)   # mkdocs.yml's paths (snippets, the API's source) are the repository's
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")   # Material's end-of-life banner, not the site's
    site = tmp_path / "site"
    caplog.set_level(logging.WARNING, logger="mkdocs")
    # In process (seconds), as `mkdocs build --strict`: every warning (a broken link or anchor, a page
    # missing from the nav, an API object that does not resolve) aborts the build; the log names each one.
    try:
        build(load_config(config_file="mkdocs.yml", site_dir=str(site), strict=True))
    except Abort as e:
        pytest.fail(f"{e}\n" + "\n".join(r.getMessage() for r in caplog.records))
    for page in ("index.html", "gpu/index.html", "tpu/index.html", "evaluation/index.html", "design/index.html",
                 "api/loss/index.html", "api/model/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    # The API pages are rendered from the docstrings (not empty headings): the loss's argument list.
    assert "valid_vocab" in (site / "api" / "loss" / "index.html").read_text()


def test_the_top_level_help_says_how_config_fields_are_set():
    assert "--config.FIELD=VALUE" in build_parser().format_help()


def _subparsers(parser):
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sub.choices


@pytest.mark.parametrize("command", sorted(_subparsers(build_parser())))
def test_every_command_help_says_how_it_takes_config_overrides(command):
    text = _subparsers(build_parser())[command].format_help()
    assert "--config.FIELD=VALUE" in text, text
