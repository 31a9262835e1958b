"""`kvguard completion bash`, run by a real bash: what it offers is what the parsers take."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "completion", "bash"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path_factory.mktemp("completion") / "kvguard.bash"
    path.write_text(done.stdout)
    return path


def offered(script: Path, *words: str) -> list[str]:
    """What bash completes for the command line `words` (the last one being typed)."""
    line = " ".join(f"'{w}'" for w in words)
    program = f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _kvguard; "
    program += 'printf "%s\\n" "${COMPREPLY[@]}"'
    done = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return sorted(done.stdout.split())


@pytest.mark.parametrize(
    ("words", "wanted"),
    [
        (("kvguard", "au"), ["audit"]),
        (("kvguard", "audit", "q"), ["query"]),
        (("kvguard", "audit", "query", "--sev"), ["--severity"]),
        (("kvguard", "audit", "query", "--severity", ""), ["critical", "high", "info", "low", "medium"]),
        (("kvguard", "alerts", "--format", ""), ["cef", "json", "ocsf"]),
        (("kvguard", "alerts", "--fo"), ["--follow", "--format"]),
        (("kvguard", "--tls-ca", "x", "fl"), ["fleet"]),  # an option's value is not a subcommand
    ],
)
def test_bash_completes_subcommands_options_and_choices(
    script: Path, words: tuple[str, ...], wanted: list[str]
) -> None:
    assert offered(script, *words) == wanted
