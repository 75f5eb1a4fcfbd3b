"""Unmodified Hugging Face models against several transformers releases: which checks pass.

    python benchmarks/compat_matrix.py                       # 4.57 (last 4.x) and the installed 5.x
    python benchmarks/compat_matrix.py --versions 4.57.6,5.23.0 --slow

For each release it installs transformers (and its own dependencies) into a folder of its own
under .venv/compat/ (`pip install --target`), puts that folder first on PYTHONPATH, and runs
tests/test_hf_models.py: analytic and measured profiles of each shipped config (Llama 3,
Qwen3, Mistral, GPT-2, Qwen3-MoE), the CLI's --hf-config, and with --slow the solver's plans
run with parity against one process. Writes benchmarks/results/compat_matrix.csv, a row per
(release, test): outcome and seconds.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / ".venv" / "compat"


def installed_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def site_for(version: str) -> Path | None:
    """A folder holding transformers==version, or None when the installed one is that version."""
    if version == installed_version():
        return None
    target = CACHE / f"transformers-{version}"
    if not (target / "transformers").is_dir():
        print(f"installing transformers=={version} into {target}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), f"transformers=={version}"],
                       check=True)
    return target


def run_checks(version: str, slow: bool) -> list[dict]:
    site = site_for(version)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    seen = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        marks = [] if slow else ["-m", "not slow"]
        subprocess.run([sys.executable, "-m", "pytest", "-q", *marks, "tests/test_hf_models.py", f"--junitxml={report}"],
                       cwd=ROOT, env=env, timeout=3600)
        rows = []
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                found = case.find(tag)
                if found is not None:
                    outcome = tag if tag == "skipped" else f"failed: {(found.get('message') or '').splitlines()[0][:160]}"
            rows.append({"transformers": seen, "test": case.get("name"), "outcome": outcome,
                         "seconds": round(float(case.get("time", 0.0)), 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=f"4.57.6,{installed_version() or '5.23.0'}",
                        help="comma-separated transformers releases (default: the last 4.x and the installed one)")
    parser.add_argument("--slow", action="store_true", help="also run the multi-process parity checks (minutes)")
    parser.add_argument("--output", default=str(RESULTS / "compat_matrix.csv"))
    args = parser.parse_args()
    rows = [row for version in args.versions.split(",") for row in run_checks(version.strip(), args.slow)]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["transformers", "test", "outcome", "seconds"])
        writer.writeheader()
        writer.writerows(rows)
    for version in sorted({r["transformers"] for r in rows}):
        mine = [r for r in rows if r["transformers"] == version]
        print(f"transformers {version}: {sum(r['outcome'] == 'passed' for r in mine)}/{len(mine)} passed")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
