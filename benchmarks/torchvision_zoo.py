"""torchvision's classification models, which the planner was not written for, through the CLI on CPU.

For each model (examples/torchvision_model.py: random weights, dropout and stochastic depth off,
64x64 images, 10 classes; 224 or 299 where the architecture needs it): `planner profile`
(measured on this CPU, micro-batches 1 and 2), then `planner solve` for a global batch of 4 at
micro-batch 2 and `planner run` for two steps, for one process and for two: free, pp2 1F1B,
pp2 zero bubble, ZeRO 3 over dp2 and tp2. Recorded per layout: ran, or the error's last line (a
refusal the solver gives before any work is a pass when it names what the model lacks), and the
largest relative difference of its losses from one process's at the same micro-batch (batch
norm normalises over each micro-batch, so only equal micro-batches compare). Adam's first steps
move each weight by about lr x sign(gradient), so rounding in gradients that are near zero
(ConvNeXt's layer scale starts at 1e-6) moves the second loss by up to ~5e-4 with no bug: one
process alone at micro-batches 1, 2 and 4 differs that much there. Losses within 1e-3 pass.

    python benchmarks/torchvision_zoo.py [MODEL ...]

Needs torchvision built for the installed torch. Writes benchmarks/results/torchvision_zoo.csv.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from hf_config_zoo import _last_line, run_each  # noqa: E402
from hf_config_zoo import planner as _planner  # noqa: E402

MODELS = ["resnet50", "convnext_tiny", "efficientnet_b0", "mobilenet_v3_small", "swin_t", "vit_b_16", "regnet_y_400mf",
          "densenet121", "squeezenet1_0", "shufflenet_v2_x0_5", "mnasnet0_5", "googlenet", "inception_v3", "alexnet",
          "wide_resnet50_2", "maxvit_t", "efficientnet_v2_s", "swin_v2_t"]
IMAGE_SIZE = {"inception_v3": 299, "maxvit_t": 224}  # the smallest each takes; others 64
LAYOUTS = {"one": ["--gpus", "1"], "free": ["--gpus", "2"], "pp2": ["--gpus", "2", "--pp", "2"],
           "pp2_zero_bubble": ["--gpus", "2", "--pp", "2", "--schedule", "zero-bubble"],
           "zero3": ["--gpus", "2", "--dp", "2", "--zero", "3"], "tp2": ["--gpus", "2", "--tp", "2"]}
LOSS_RTOL = 1e-3
TIMEOUT_S = 900


def planner(*args: str):
    return _planner(*args, cwd=ROOT, timeout_s=TIMEOUT_S)


def try_model(name: str, work: Path) -> dict:
    args = ["-a", f"name={name}", "-a", f"image_size={IMAGE_SIZE.get(name, 64)}", "-a", "num_classes=10"]
    done = planner("profile", "examples/torchvision_model.py", *args, "--micro-batch-sizes", "1,2", "--device", "cpu",
                   "-o", str(work / "profile.json"))
    row: dict = {"model": name, "profiled": done.returncode == 0}
    if done.returncode:
        return {**row, "note": _last_line(done)}
    losses = {}
    for layout, pins in LAYOUTS.items():
        plan = work / f"{layout}.json"
        done = planner("solve", "-p", str(work / "profile.json"), "--gpu", "cpu", "-b", "4", "--micro-batch", "2", *pins,
                       "-o", str(plan))
        if done.returncode == 0:
            done = planner("run", str(plan), "--steps", "2", "-o", str(work / f"metrics-{layout}.json"))
        if done.returncode:
            row[layout] = "error: " + _last_line(done)
            continue
        losses[layout] = json.loads((work / f"metrics-{layout}.json").read_text())["losses"]
        lay = json.loads(plan.read_text())["layout"]
        row[layout] = f"ran pp{lay['pp_degree']} dp{lay['dp_degree']} tp{lay['tp_degree']} zero{lay['zero_stage']}"
    reference = losses.get("one")
    for layout, got in losses.items():
        if reference and layout != "one":
            error = max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True))
            row[f"{layout}_loss_error"] = error
            row[f"{layout}_losses_match"] = error <= LOSS_RTOL
    return row


def main(models: list[str]) -> pd.DataFrame:
    return run_each(models, MODELS, try_model, "torchvision_zoo", "model")


if __name__ == "__main__":
    main(sys.argv[1:])
