"""The documentation: ``docs/`` builds as a site with MkDocs in strict mode (a broken link between
pages, or a page missing from the navigation, fails the build), and every page the README links
to exists, and every ``thaw`` command the pages show is one the CLI takes. README's own commands
run as written in tests/infra/test_readme_quickstart_e2e.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.doc_commands import doc_commands

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = str(Path(sys.executable).parent / "mkdocs")


def test_the_docs_build_strictly_with_every_page_in_the_navigation(tmp_path):
    result = subprocess.run([MKDOCS, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = {page for item in config["nav"] for page in item.values()}
    assert in_nav == {p.name for p in (ROOT / "docs").glob("*.md")}
    for page in in_nav:
        built = tmp_path / "site" / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built.is_file(), page


def test_every_page_the_readme_links_to_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#:]+)\)", readme)
    assert "docs/deploying.md" in links and "docs/api.md" in links
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert missing == []


def test_every_thaw_command_in_the_docs_is_one_the_cli_takes():
    """Each command shown parses with today's CLI: a renamed flag or command fails here. (What
    they do is tested where it is built; the README's quick start runs as written end to end.)"""
    import contextlib
    import io

    from infra.cli import build_parser

    commands = [(c.where, c.argv) for c in doc_commands()]
    assert len(commands) >= 25  # the pages' commands were found, not an empty list
    refused = []
    for where, argv in commands:
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                build_parser().parse_args(argv)
        except SystemExit:
            refused.append(f"{where}: {errors.getvalue().strip().splitlines()[-1]}")
    assert refused == []
