"""Hand-written plans for the runtime tests (the plan file is the contract; no solver needed)."""

from __future__ import annotations

from planner.plan import Batch, ClusterRef, Layout, ModelRef, Plan, Stage, stage_ranks
from tests.conftest import EXAMPLES

GPT_ARGS = dict(n_layers=4, d_model=32, n_heads=4, d_ff=64, vocab_size=64, seq_len=16)
GPT_UNITS = ["embed"] + [f"blocks.{i}" for i in range(4)] + ["norm", "head"]
LLAMA_ARGS = dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=16)
LLAMA_UNITS = ["embed", "layers.0", "layers.1", "norm", "output"]


def megatron_tp_plan(prefix: str, n: int, attn: tuple, mlp_col: tuple, mlp_row: str, attn_out: str) -> dict:
    plan = {}
    for i in range(n):
        plan.update({f"{prefix}.{i}.{m}": "colwise" for m in attn + mlp_col})
        plan.update({f"{prefix}.{i}.{attn_out}": "rowwise", f"{prefix}.{i}.{mlp_row}": "rowwise"})
    return plan


GPT_TP = {**megatron_tp_plan("blocks", 4, ("attn.wq", "attn.wk", "attn.wv"), ("mlp.fc_in",), "mlp.fc_out", "attn.wo"), "head": "colwise"}
LLAMA_TP = megatron_tp_plan("layers", 2, ("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3"),
                            "feed_forward.w2", "attention.wo")


def make_plan(model: str = "gpt", pp=1, dp=1, tp=1, zero=0, schedule="1f1b", v=1, cuts=None, mbs=2, m=2,
              tp_plan=None, recompute="none", units=None, args=None) -> Plan:
    args = args if args is not None else (GPT_ARGS if model == "gpt" else LLAMA_ARGS)
    units = units or (GPT_UNITS if model == "gpt" else LLAMA_UNITS)
    lay = Layout(pp_degree=pp, dp_degree=dp, tp_degree=tp, zero_stage=zero, schedule=schedule, virtual_stages=v)
    num_stages = pp * v
    cuts = cuts or [round(k * len(units) / num_stages) for k in range(num_stages + 1)]
    stages = []
    for k in range(num_stages):
        mine = units[cuts[k]:cuts[k + 1]]
        owned = {n: s for n, s in (tp_plan or {}).items() if any(n == u or n.startswith(u + ".") for u in mine)}
        stages.append(Stage(units=mine, ranks=stage_ranks(lay, k), recompute=recompute, tp_plan=owned if tp > 1 else {}))
    return Plan(
        model=ModelRef(file=str(EXAMPLES / f"{model}.py"), args=args),
        cluster=ClusterRef(name="cpu", gpus_per_node=pp * dp * tp, gpu="cpu"),
        batch=Batch(global_batch_size=mbs * m * dp, micro_batch_size=mbs, num_microbatches=m),
        layout=lay,
        stages=stages,
    )


def make_2bw_plan(**kwargs) -> Plan:
    """A hand-written plan with the asynchronous pipedream-2bw schedule (planner/plan.py `Schedule`);
    m defaults to 4, at least pp as 2BW needs."""
    return make_plan(schedule="pipedream-2bw", **{"m": 4, **kwargs})
