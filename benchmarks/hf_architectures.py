"""Hugging Face architectures the planner was not written for, through every basic layout on CPU.

Each model is a small `transformers` class used unchanged from a model file (an encoder, an
encoder-decoder, a vision transformer, a speech encoder-decoder, a mixture of experts, a
decoder with a fused q/k/v): BERT (examples/hf_bert.py), T5, ViT, Whisper, Mixtral and
GPT-NeoX. For each, on two gloo processes: a measured profile, the solver's plan for the
pinned layout (dp2, pp2 1F1B, pp2 zero bubble, tp2 without SP, ZeRO 3 over dp2), a run of
a few steps, and the first loss held to the one-process reference's (every model here runs
without dropout). Recorded per case: whether it ran, the loss check, and the predicted against
the measured tensor peak of the busiest rank. Times are recorded too but on a 2-core
machine's gloo they say little (README: predictions on CPU).

    OMP_NUM_THREADS=1 python benchmarks/hf_architectures.py [MODEL ...]

Writes benchmarks/results/hf_architectures.csv.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cluster import make_cluster  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.plan import rank_peak_bytes  # noqa: E402
from planner.profiler import profile_model  # noqa: E402
from planner.solver.solve import Pins, solve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
STEPS = 3

_TOKENS = """
def make_batch(batch_size, seq=16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 128, (batch_size, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
"""
_LOSS = """
def loss_fn(output, targets):
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
"""
_HEADER = "import torch\nimport torch.nn.functional as F\n"
SOURCES = {
    "t5": _HEADER + """
from transformers import T5Config, T5ForConditionalGeneration

def build_model():
    return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                               decoder_start_token_id=0, dropout_rate=0.0))

def make_batch(batch_size, seq=16):
    g = torch.Generator().manual_seed(0)
    source = torch.randint(1, 128, (batch_size, seq), generator=g)
    target = torch.randint(1, 128, (batch_size, seq + 1), generator=g)
    return (source, None, target[:, :-1]), target[:, 1:]
""" + _LOSS,
    "vit": _HEADER + """
from transformers import ViTConfig, ViTForImageClassification

def build_model():
    return ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=64, image_size=16, patch_size=4, num_labels=10,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 3, 16, 16, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
""" + _LOSS,
    "whisper": _HEADER + """
from transformers import WhisperConfig, WhisperForConditionalGeneration

def build_model():
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=128, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, dropout=0.0, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1))

def make_batch(batch_size):
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch_size, 16, 32, generator=g)  # (batch, mel bins, 2 x source positions)
    tokens = torch.randint(3, 128, (batch_size, 17), generator=g)
    return (features, None, tokens[:, :-1]), tokens[:, 1:]
""" + _LOSS,
    "mixtral": _HEADER + """
from transformers import MixtralConfig, MixtralForCausalLM

def build_model():
    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64))
""" + _TOKENS + _LOSS,
    "gpt_neox": _HEADER + """
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

def build_model():
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=64))
""" + _TOKENS + _LOSS,
}
LAYOUTS = {
    "dp2": Pins(pp=1, dp=2, tp=1, zero_stage=0),
    "pp2-1f1b": Pins(pp=2, dp=1, tp=1, schedule="1f1b"),
    "pp2-zero-bubble": Pins(pp=2, dp=1, tp=1, schedule="zero-bubble"),
    "tp2": Pins(pp=1, dp=1, tp=2, sequence_parallel=False),
    "zero3": Pins(pp=1, dp=2, tp=1, zero_stage=3),
}
GLOBAL_BATCH = 4


def _run(plan_path: Path, out: Path, reference: bool = False) -> dict:
    command = [sys.executable, "-m", "planner.cli", "run", str(plan_path), "--steps", str(STEPS), "--output", str(out)]
    ran = subprocess.run(command + (["--reference"] if reference else []), cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    if ran.returncode:
        raise RuntimeError(" ".join(ran.stderr.split())[-300:])
    return json.loads(out.read_text())


def model_file(name: str, directory: Path) -> Path:
    if name == "bert":
        return ROOT / "examples" / "hf_bert.py"
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(SOURCES[name]))
    return path


def main(names: list[str]) -> None:
    rows = []
    cluster = make_cluster(2, gpu="cpu")
    for name in names or ["bert", *SOURCES]:
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            profile = profile_model(str(model_file(name, directory)), {}, [1, 2], device="cpu", repeats=2, warmup=1)
            for layout, pins in LAYOUTS.items():
                row = dict(model=name, layout=layout)
                try:
                    plan = solve(profile, cluster, GLOBAL_BATCH, pins)
                except PlannerError as error:
                    rows.append({**row, "status": "refused: " + error.message.split(":")[0]})
                    print(f"{name:9s} {layout:16s} refused: {error.message[:120]}")
                    continue
                path = plan.save(directory / f"{layout}.json")
                try:
                    metrics = _run(path, directory / f"{layout}-metrics.json")
                    reference = _run(path, directory / f"{layout}-reference.json", reference=True)
                except RuntimeError as error:
                    rows.append({**row, "status": f"failed: {error}"})
                    print(f"{name:9s} {layout:16s} FAILED {error}")
                    continue
                predicted, measured = max(rank_peak_bytes(plan)), max(metrics["peak_tensor_bytes"])
                same = abs(metrics["losses"][0] - reference["losses"][0]) <= 1e-4 * abs(reference["losses"][0])
                rows.append({**row, "status": "ran", "first_loss_matches_reference": same,
                             "predicted_peak_bytes": int(predicted), "measured_peak_bytes": int(measured),
                             "memory_error": round(predicted / measured - 1, 4),
                             "predicted_iteration_s": plan.prediction.iteration_time_s,
                             "measured_iteration_s": metrics["median_iteration_time_s"]})
                print(f"{name:9s} {layout:16s} ran; first loss {'=' if same else '!='} reference; "
                      f"memory {predicted / 2**20:6.2f} MiB predicted, {measured / 2**20:6.2f} measured "
                      f"({predicted / measured - 1:+.1%})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "hf_architectures.csv"
    fields = ["model", "layout", "status", "first_loss_matches_reference", "predicted_peak_bytes", "measured_peak_bytes",
              "memory_error", "predicted_iteration_s", "measured_iteration_s"]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    ran = [r for r in rows if r["status"] == "ran"]
    within = sum(abs(r["memory_error"]) <= 0.10 for r in ran)
    print(f"{len(ran)}/{len(rows)} ran, {sum(r['first_loss_matches_reference'] for r in ran)} with the reference's first "
          f"loss, {within} within 10% of the measured peak; wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
