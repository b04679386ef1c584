"""The dependency floors' fingerprint: .ci/oldest.txt and the requirements pyproject.toml gives
kvrun and its test extra. `.ci/run oldest` writes it to .ci/oldest.passed when the suite passes
there; tests/test_packaging.py refuses floors that changed since (python .ci/floors.py prints it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def fingerprint() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = [
        line.strip()
        for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return hashlib.sha256("\n".join(sorted(reqs) + ["--"] + sorted(pins)).encode()).hexdigest()


if __name__ == "__main__":
    print(fingerprint())
