"""The docs say what the code says: the generated reference pages (CLI, API) are what scripts/dev/gen_docs.py makes
now, every flag of every `stagemesh` subcommand is on the CLI page, the README stays short, every relative link
in the README and the docs resolves, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import difflib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250
REGENERATE = "run `python scripts/dev/gen_docs.py` and commit the pages it writes"


@pytest.fixture(scope="module")
def gen_docs():
    """scripts/dev/gen_docs.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "dev" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_are_up_to_date(gen_docs):
    pages = gen_docs.pages()
    assert {p.relative_to(ROOT).as_posix() for p in pages} == {"docs/reference/cli.md", "docs/reference/api.md"}
    for path, expected in pages.items():
        name = path.relative_to(ROOT).as_posix()
        assert path.exists(), f"{name} is missing: {REGENERATE}"
        actual = path.read_text()
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), name,
                                                 f"{name} as generated now"))[:40])
        assert actual == expected, f"{name} is stale: {REGENERATE}\n{diff}"


def test_every_flag_of_every_subcommand_is_on_the_cli_page(gen_docs):
    page = (DOCS / "reference" / "cli.md").read_text()
    with gen_docs._without_stagemesh_environment():
        parser = gen_docs.cli.build_parser()
    commands = gen_docs._subparsers(parser)
    assert commands, "the stagemesh parser has no subcommands"
    sections = {m.group(1): m.start() for m in re.finditer(r"^## stagemesh (\S+)$", page, re.MULTILINE)}
    missing_sections = sorted(set(commands) - set(sections))
    assert not missing_sections, f"subcommands without a section on the CLI page: {missing_sections}; {REGENERATE}"
    starts = sorted(sections.values()) + [len(page)]
    missing = []
    for name, sub in [("", parser), *commands.items()]:
        if name:
            start = sections[name]
            section = page[start:starts[starts.index(start) + 1]]
        else:  # the options of `stagemesh` itself come before the first subcommand's section
            section = page[:min(sections.values())]
        for action in gen_docs.documented_actions(sub):
            names = action.option_strings or [action.metavar or action.dest]
            missing += [f"stagemesh {name} {flag}".replace("  ", " ") for flag in names if f"`{flag}`" not in section]
    assert not missing, f"flags missing from docs/reference/cli.md: {missing}; {REGENERATE}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; keep it to {README_MAX_LINES} (what it is, "
                                       "status, quick start, links) and move the rest into docs/")


_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def relative_links(markdown: str) -> list[str]:
    """The link targets of a Markdown text that are paths (no scheme, not a bare #anchor), outside code."""
    text = _INLINE_CODE.sub("", _FENCE.sub("", markdown))
    targets = _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)
    return [t for t in targets if not _SCHEME.match(t) and not t.startswith("#")]


def test_the_link_finder_sees_links_and_skips_code():
    text = ("[a](docs/a.md) ![b](img.png#x) [c](https://x.org) [d](#anchor) `[e](no.md)`\n"
            "```\n[f](no.md)\n```\n[g]: ref.md\n")
    assert relative_links(text) == ["docs/a.md", "img.png#x", "ref.md"]


def test_every_relative_link_in_the_readme_and_the_docs_points_to_a_file():
    files = [README, *sorted(DOCS.rglob("*.md"))]
    broken, seen = [], 0
    for path in files:
        for target in relative_links(path.read_text()):
            seen += 1
            file_part = target.split("#", 1)[0].split("?", 1)[0]
            if file_part and not (path.parent / file_part).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert seen and relative_links(README.read_text()), "no relative links found: is the link finder blind?"
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs mkdocs-material)")
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    assert (site / "index.html").exists() and (site / "reference" / "cli" / "index.html").exists()
