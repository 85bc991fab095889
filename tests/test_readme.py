"""The README's promises that a test can hold: CI runs exactly its test command, it stays short, its
links resolve, and every figure it quotes is found where it links (``benchmarks/README.md`` or a page of
``docs/``), so the two never disagree."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A number as the README writes one: 82.3, 16000.1, 8,192, 0.0.52, 2603.26663 (signs are not part of it).
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def _prose(markdown: str) -> str:
    """The text outside fenced code blocks, link targets removed (commands and anchors are not figures)."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return re.sub(r"\]\([^)]*\)", "]", text)


def _figures(text: str) -> set:
    # A figure ends before a sentence's full stop or a trailing comma ("1.0 and", "20.9, the"): the
    # pattern takes only digits after a '.' or ','.
    return set(NUMBER.findall(_prose(text)))


def _found(figure: str, text: str) -> bool:
    """``figure`` is a whole number in ``text``: 41 is not found in 141 nor in 4.41 nor in 41.5."""
    return re.search(rf"(?<![\d.,]){re.escape(figure)}(?!\d|[.,]\d)", text) is not None


def _section(markdown: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, flags=re.S | re.M)
    assert match, f"the README has no section '## {title}'"
    return match.group(1)


def test_ci_runs_exactly_the_readme_test_command():
    readme_commands = re.findall(r"```bash\n(.*?)\n```", _read("README.md"), flags=re.S)
    ci_command = _read(".ci/run").strip().splitlines()[-1]
    assert ci_command in [c.strip() for c in readme_commands], (
        "the last line of .ci/run must be one of the README's bash commands, verbatim")


def test_the_readme_reads_in_five_minutes():
    lines = _read("README.md").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/ (at most 200)"
    for title in ("Run the study", "Run the tests", "Commands", "Headline figures"):
        _section(_read("README.md"), title)


def test_every_link_of_the_readme_resolves():
    for target in LINK.findall(_read("README.md")):
        if "://" not in target:
            assert os.path.exists(os.path.join(REPO, target)), f"README.md links to {target}, which does not exist"


def test_every_headline_figure_is_found_where_its_row_links():
    """Row by row: each figure of the "Headline figures" table is in the file its row links to ("the
    same": the row above's)."""
    rows = [r for r in _section(_read("README.md"), "Headline figures").splitlines() if r.startswith("| ")][1:]
    assert len(rows) >= 6, "the headline table lost its rows"
    source = None
    for row in rows:
        *figures, where = row.strip("|").split(" | ")
        links = LINK.findall(where)
        if links:
            source = links[0]
        assert source, f"the first headline row links nowhere: {row}"
        text = _read(source)
        missing = sorted(f for f in _figures(" ".join(figures)) if not _found(f, text))
        assert not missing, f"{missing} quoted in the README's row '{figures[0]}' are not in {source}"


def test_the_set_up_durations_and_the_commands_figures_are_those_of_getting_started():
    """The durations of the two set-up commands and of every command are the ones the getting-started
    page records (with their load and date)."""
    readme, page = _read("README.md"), _read("docs/getting-started.md")
    for title in ("Run the study", "Run the tests", "Commands"):
        missing = sorted(f for f in _figures(_section(readme, title)) if not _found(f, page))
        assert not missing, f"{missing} in the README's '{title}' are not in docs/getting-started.md"


def test_every_figure_of_the_readme_is_in_the_benchmarks_or_a_page_it_links():
    readme = _read("README.md")
    sources = {"benchmarks/README.md"} | {t for t in LINK.findall(readme) if t.endswith(".md")}
    known = "\n".join(_read(s) for s in sorted(sources))
    missing = sorted(f for f in _figures(readme) if not _found(f, known))
    assert not missing, (f"figures in README.md found neither in benchmarks/README.md nor in a page it links "
                         f"({', '.join(sorted(sources))}): {missing}")
