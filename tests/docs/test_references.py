"""Every document the repository's files point at is in the repository: markdown links in the
guides, `docs/...`/`bench/...` paths and bare `NAME.md` names in code, units and configuration
(a reader who follows one finds it), and the project URLs of pyproject.toml."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT = (".py", ".md", ".toml", ".service", ".conf", ".yaml", ".yml", ".c", ".h", ".sh", ".proto", "Makefile")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")  # a markdown link to a document
NAMED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Za-z][\w-]*\.md)\b")  # docs/operator.md, EVENTS.md


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [
        REPO / line
        for line in out.splitlines()
        if line.endswith(TEXT) and "/__snapshots__/" not in line and line != "tests/docs/test_references.py"
    ]


def resolves(source: Path, name: str) -> bool:
    """Whether `name`, as written in `source`, names a file: beside it, or from the root."""
    return (source.parent / name).is_file() or (REPO / name).is_file() or (REPO / "docs" / name).is_file()


def test_every_document_named_exists() -> None:
    missing = []
    for path in tracked():
        text = path.read_text(errors="replace")
        names = set(LINK.findall(text)) | set(NAMED.findall(text))
        for name in names:
            if name.startswith(("http", "../shared")) or "://" in name:
                continue
            if not resolves(path, name):
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(sorted(missing))


def test_the_project_urls_name_documents_that_exist() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    for url in re.findall(r'"https://github\.com/kvguard/kvguard/blob/main/([^"#]+)', pyproject):
        assert (REPO / url).is_file(), url
    for unit in (REPO / "deploy/systemd").glob("*.service"):
        for url in re.findall(
            r"Documentation=https://github\.com/kvguard/kvguard/blob/main/(\S+)", unit.read_text()
        ):
            assert (REPO / url).is_file(), (unit.name, url)
