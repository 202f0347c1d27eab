"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs): every link
between pages and every anchor resolves (mkdocs.yml ``validation``), every page is in the nav, and
the pages included from the repository (docs/hooks/repo_pages.py) render. External links are not
fetched (the build machine has no internet)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mkdocs_strict_build(tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    for page in ("index.html", "serving/configuration/index.html", "deploy/helm-chart/index.html",
                 "benchmarks/index.html", "reference/cli/index.html", "reference/settings/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert not (tmp_path / "site" / "hooks").exists(), "the build hook must not be published"
    chart = (tmp_path / "site" / "deploy" / "helm-chart" / "index.html").read_text(encoding="utf-8")
    assert "values-table:begin" in chart or "poolDefaults.replicas" in chart  # the chart README's values table
