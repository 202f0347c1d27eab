"""mkdocs hook: pages that live beside what they describe, included into the site at build time.

The Helm chart's README stays in the chart (``helm show readme`` and tests/deploy/ read it there)
and the measured figures stay in benchmarks/README.md (next to the scripts that produce them); the
site shows both as pages of its own without a copy that could drift. mkdocs loads this file by path
(``hooks:`` in mkdocs.yml); ``exclude_docs`` keeps it out of the site.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

# site page -> repository file (relative to the folder of mkdocs.yml)
PAGES = {
    "deploy/helm-chart.md": "deploy/helm/duet/README.md",
    "benchmarks.md": "benchmarks/README.md",
}


def on_files(files: Files, config: Any) -> Files:
    root = Path(config.config_file_path).parent
    for page, source in PAGES.items():
        files.append(File.generated(config, page, content=(root / source).read_text(encoding="utf-8")))
    return files
