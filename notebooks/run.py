"""Run the report notebook headless (what `make notebook` calls), with nbclient and the venv's own kernel.

    python notebooks/run.py [SWEEP_DIR] [--out OUT.ipynb]

SWEEP_DIR: a sweep dir (default: the newest under outputs/sweeps/). The executed notebook, with its figures,
is written to OUT (default: SWEEP_DIR/report/nondeterminism_report.ipynb).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "nondeterminism_report.ipynb"


def run(sweep_dir: str | Path, out: str | Path | None = None, timeout: int = 600) -> Path:
    """Execute the notebook against `sweep_dir` (its parameter cell set to it); returns the written notebook."""
    sweep_dir = Path(sweep_dir).resolve()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = f"sweep_dir = {str(sweep_dir)!r}\nwandb_path = None"
    # python3 = ipykernel's own spec: the kernel runs in this interpreter (the venv that has detrl)
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}
    ).execute()
    out = Path(out) if out else sweep_dir / "report" / NOTEBOOK.name
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python notebooks/run.py", description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", nargs="?", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sweeps = sorted((HERE.parent / "outputs" / "sweeps").glob("*/"), key=lambda p: p.stat().st_mtime)
    sweep_dir = args.sweep_dir or (sweeps[-1] if sweeps else None)
    if sweep_dir is None or not Path(sweep_dir).is_dir():
        print(
            f"notebooks/run.py: no sweep dir {sweep_dir or 'under outputs/sweeps/'}; run a sweep first",
            file=sys.stderr,
        )
        sys.exit(2)
    print(f"notebook executed: {run(sweep_dir, args.out)}")


if __name__ == "__main__":
    main()
