"""The README and docs/ pages: every relative link and image points to a file (or heading) that exists.

The command examples in them are checked against each command's options in tests/test_cli.py; the README's
generated "what you get" block against bench/results/demo.json in tests/test_bench.py."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_the_docs_resolves():
    checked = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)}: link to {target}: no such file"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                assert fragment in {anchor(h) for h in headings}, f"{page.relative_to(ROOT)}: no heading #{fragment}"
            checked += 1
    assert checked >= 10  # the README alone links the docs pages, RESULTS.md and the heal curve


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in readme, f"docs/{page.name} is not linked from the README"


def test_every_repository_path_the_docs_name_exists():
    """A path in backticks (`tlm_io/data/README.md`, `recipes/cpt/...yaml`) names a file or folder of this tree, so a
    package move that forgets a page fails here (bench/results/ files are outputs a run may not have written yet)."""
    named = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        named |= {(page, p) for p in re.findall(r"`((?:tlm\w*|bench|tools|recipes|tests|docs)/[\w./-]*)`", text)}
    named = {(page, p) for page, p in named if not p.startswith("bench/results/")}  # what a benchmark will write
    missing = [f"{page.relative_to(ROOT)}: {p}" for page, p in sorted(named) if not (ROOT / p).exists()]
    assert not missing, missing
    assert len(named) >= 10
