"""The ``thaw`` commands the README and the docs show, read from the pages themselves (for
tests/test_docs.py, which parses each with the CLI, and the README end-to-end test, which runs them)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class DocCommand:
    page: str  # "docs/deploying.md"
    text: str  # the command as the page shows it
    argv: list[str]  # what follows ``thaw``

    @property
    def where(self) -> str:
        return f"{self.page}: {self.text}"

    @property
    def subcommand(self) -> str:
        """"deploy", "tenants create", "models push": the words before the first argument."""
        words = []
        for word in self.argv:
            if word.startswith("-") or not word.replace("-", "").isalpha() or not word.islower():
                break
            words.append(word)
            if word not in ("tenants", "keys", "models"):
                break
        return " ".join(words)


def doc_commands() -> list[DocCommand]:
    """Every ``thaw`` command in the README's and the docs' bash blocks, in page order:
    continuation lines joined, comments dropped, ``a && b`` and ``a / b`` split; a synopsis's
    ``[...]`` groups kept, with ``[a | b]`` and ``x|y`` taken as their first and ``...`` dropped."""
    commands = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s#\s.*$", "", line)
                line = re.sub(r"\[([^\]|]*?)\s\|\s[^\]]*\]", r"[\1]", line)  # [a | b]: a
                for part in re.split(r"\s&&\s|\s/\s", line):
                    words = shlex.split(part.replace("[", " ").replace("]", " "))
                    if not words or words[0] not in ("thaw", ".venv/bin/thaw"):
                        continue
                    argv = [w.split("|")[0] for w in words[1:] if w != "..."]
                    commands.append(DocCommand(str(page.relative_to(ROOT)), " ".join(part.split()), argv))
    return commands
