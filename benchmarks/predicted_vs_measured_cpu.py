"""Predicted vs measured on CPU gloo processes: predicted_vs_measured.py with --device cpu.

    python benchmarks/predicted_vs_measured_cpu.py --gpus 2                          # free choice
    python benchmarks/predicted_vs_measured_cpu.py --gpus 2 --pin "--pp 2 --schedule 1f1b"
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from predicted_vs_measured import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--device", "cpu", "--gpu", "cpu"]
    main()
