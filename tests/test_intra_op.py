"""The tensor-parallel ILP: Megatron's pairing rediscovered, tiny units kept whole, optimal vs brute force."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass

import pytest

from planner.errors import PlannerError
from planner.profiler import profile_model
from planner.solver.intra_op import IntraOpProblem, _build_graph, evaluate, solve_intra_op

GPT_BIG = dict(n_layers=1, d_model=2048, n_heads=16, d_ff=8192, vocab_size=32000, seq_len=1024)
LLAMA_BIG = dict(n_layers=1, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=5632, vocab_size=32000, seq_len=1024)


@dataclass(frozen=True)
class Ring:
    """Ring collectives, alpha-beta (NVLink-like numbers)."""

    group_size: int
    bandwidth: float = 300e9
    alpha_s: float = 5e-6

    def all_reduce_s(self, nbytes: float) -> float:
        return 2 * (self.group_size - 1) * (self.alpha_s + nbytes / self.group_size / self.bandwidth)

    def all_gather_s(self, nbytes: float) -> float:
        return (self.group_size - 1) * (self.alpha_s + nbytes / self.group_size / self.bandwidth)

    def reduce_scatter_s(self, nbytes: float) -> float:
        return self.all_gather_s(nbytes)

    def all_to_all_s(self, nbytes: float) -> float:
        return (self.group_size - 1) * (self.alpha_s + nbytes / self.group_size**2 / self.bandwidth)


def _block_ops(model_file: str, args: dict):
    prof = profile_model(model_file, args, [1], device="meta")
    return tuple(prof.units[1].ops), prof


@pytest.fixture(scope="module")
def gpt_block():
    return _block_ops("examples/gpt.py", GPT_BIG)


@pytest.fixture(scope="module")
def llama_block():
    return _block_ops("examples/llama.py", LLAMA_BIG)


def _problem(ops, tp, **kw) -> IntraOpProblem:
    return IntraOpProblem(ops=ops, tp_degree=tp, dtype_bytes=2, seconds_per_flop=1 / 250e12, collectives=Ring(tp), **kw)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_block_rediscovers_megatron(gpt_block, tp, sequence_parallel):
    ops, _ = gpt_block
    sol = solve_intra_op(_problem(ops, tp, sequence_parallel=sequence_parallel))
    assert sol.tp_plan == {
        "attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise", "attn.wo": "rowwise",
        "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise",
    }
    assert sol.strategies["attention_1"] == "heads"
    forward = [c for c in sol.collectives if c.startswith("fwd P->")]
    # One reduction per (column, row) pair in forward: all-reduce, or reduce-scatter under SP.
    assert sorted(c.split()[-1] for c in forward) == ["attn.wo", "mlp.fc_out"]
    if not sequence_parallel:
        assert [c.split()[1] for c in forward] == ["P->R", "P->R"]
        assert len(sol.collectives) == 4  # + the two backward all-reduces of the conjugate f operators


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_block_rediscovers_megatron(llama_block, tp):
    ops, _ = llama_block
    sol = solve_intra_op(_problem(ops, tp))
    assert sol.tp_plan == {
        "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    }
    assert sorted(c for c in sol.collectives if c.startswith("fwd")) == ["fwd P->R attention.wo", "fwd P->R feed_forward.w2"]


def test_gqa_heads_limit_tp(llama_block):
    """8 kv heads: tp=16 cannot split wk/wv by whole heads, so they are not colwise."""
    ops, _ = llama_block
    sol = solve_intra_op(_problem(ops, 16))
    assert sol.tp_plan["attention.wk"] != "colwise" and sol.tp_plan["attention.wv"] != "colwise"


def test_small_unit_stays_replicated():
    ops, _ = _block_ops("examples/gpt.py", {"n_layers": 1})  # d_model 64, 32 tokens: latency dominates
    for tp in (2, 4, 8):
        sol = solve_intra_op(_problem(ops, tp))
        assert set(sol.tp_plan.values()) == {"replicate"}
        assert sol.comm_time_s == 0


def test_parameter_memory_forces_sharding_or_fails(gpt_block):
    ops, _ = gpt_block
    free = solve_intra_op(_problem(ops, 2, sequence_parallel=False))
    replicated = evaluate(_problem(ops, 2), {k: "replicate" for k in free.strategies if not k.startswith("merge")} | {k: "R" for k in free.strategies if k.startswith("merge")})
    assert free.parameter_bytes == pytest.approx(replicated.parameter_bytes / 2, rel=0.01)
    with pytest.raises(PlannerError, match="parameter_memory"):
        solve_intra_op(_problem(ops, 2, parameter_bytes_limit=free.parameter_bytes * 0.5))


def _brute_force(problem: IntraOpProblem) -> float:
    graph = _build_graph(problem)
    free = {v: list(s) for v, s in graph.nodes.items() if "fixed" not in s}
    best = float("inf")
    for combo in itertools.product(*free.values()):
        sol = evaluate(problem, dict(zip(free, combo)))
        if problem.parameter_bytes_limit is None or sol.parameter_bytes <= problem.parameter_bytes_limit:
            best = min(best, sol.compute_time_s + sol.comm_time_s)
    return best


@pytest.mark.parametrize(
    "bandwidth, flops, sp",
    [(300e9, 250e12, False), (25e9, 250e12, True), (300e9, 2e12, False), (1e9, 1e15, True)],
)
def test_ilp_matches_brute_force(gpt_block, bandwidth, flops, sp):
    """The ILP optimum equals exhaustive search over every strategy assignment (same cost function)."""
    ops, _ = gpt_block
    problem = IntraOpProblem(ops, 2, 2, 1 / flops, Ring(2, bandwidth), sequence_parallel=sp)
    sol = solve_intra_op(problem)
    assert sol.compute_time_s + sol.comm_time_s == pytest.approx(_brute_force(problem), rel=1e-6)


@pytest.mark.parametrize("block", ["gpt_block", "llama_block"])
@pytest.mark.parametrize("tp, bandwidth, flops, sp, pinned, memory", [
    (2, 300e9, 250e12, False, False, None), (4, 25e9, 250e12, True, False, None), (8, 300e9, 2e12, False, True, None),
    (2, 1e9, 1e15, False, True, None), (4, 1e9, 1e15, False, False, 0.6), (8, 50e9, 1e14, True, True, 0.3)])
def test_table_and_ilp_agree(request, block, tp, bandwidth, flops, sp, pinned, memory, monkeypatch):
    """The numpy table (`_by_table`) and CBC find the same optimum, under the memory limit (a share
    of the replicated unit's parameters) and the pinned-TP constraint too."""
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, "")
    ops, _ = request.getfixturevalue(block)
    limit = None if memory is None else memory * sum(intra_op._node_cost(_problem(ops, tp), op, "replicate")[2] for op in ops)
    problem = IntraOpProblem(ops, tp, 2, 1 / flops, Ring(tp, bandwidth), sequence_parallel=sp,
                             require_sharding=pinned, parameter_bytes_limit=limit)
    graph = _build_graph(problem)
    free = {v: s for v, s in graph.nodes.items() if "fixed" not in s}
    table = intra_op._by_table(problem, graph, free)
    ilp = evaluate(problem, intra_op._solve_ilp(problem, graph, free))
    assert table.compute_time_s + table.comm_time_s == pytest.approx(ilp.compute_time_s + ilp.comm_time_s, rel=1e-9)
    if limit is not None:
        assert table.parameter_bytes <= limit
    if pinned:
        assert {"colwise", "rowwise"} & set(table.strategies.values())


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 8])
def test_pinned_tp_shards_the_token_embedding_not_only_the_positions(gpt_block, tp, sp, monkeypatch):
    """Under TP the unit's largest weight is sharded: GPT's token embedding (vocabulary x d_model),
    which the all-reduce or all-gather of its output makes dearer to shard than to keep whole.
    Sharding only the small position table would satisfy "some weight sharded" and leave the
    full vocabulary on every rank, which no TP runtime does (Megatron-LM's
    VocabParallelEmbedding). The table and the ILP agree."""
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, "")
    _, prof = gpt_block
    embed = prof.units[0]
    shapes = {op.name: op.weight_shape for op in embed.ops}
    assert shapes == {"tok": [GPT_BIG["vocab_size"], GPT_BIG["d_model"]], "pos": [GPT_BIG["seq_len"], GPT_BIG["d_model"]]}
    free_problem = _problem(tuple(embed.ops), tp, sequence_parallel=sp)
    assert solve_intra_op(free_problem).strategies["tok"] == "replicate"  # unpinned, the collective is not worth it
    problem = dataclasses.replace(free_problem, require_sharding=True)
    graph = _build_graph(problem)
    free = {v: st for v, st in graph.nodes.items() if "fixed" not in st}
    for chosen in (intra_op._by_table(problem, graph, free).strategies, intra_op._solve_ilp(problem, graph, free)):
        assert chosen["tok"] in ("colwise", "rowwise")
    whole = evaluate(problem, {**_replicated(free), "tok": "replicate"}).parameter_bytes
    assert solve_intra_op(problem).parameter_bytes < whole / tp + 2 * GPT_BIG["seq_len"] * GPT_BIG["d_model"]


def _replicated(free: dict) -> dict[str, str]:
    """Every free node replicated (R for the merges)."""
    return {v: ("R" if v.startswith("merge") else "replicate") for v in free}


def test_table_refuses_what_the_ilp_refuses(gpt_block, monkeypatch):
    """No assignment under the memory limit: the table raises the ILP's error, before any ILP."""
    import planner.solver.intra_op as intra_op

    ops, _ = gpt_block
    problem = _problem(ops, 2, parameter_bytes_limit=1.0)
    graph = _build_graph(problem)
    free = {v: s for v, s in graph.nodes.items() if "fixed" not in s}
    with pytest.raises(PlannerError, match="parameter_memory"):
        intra_op._by_table(problem, graph, free)


# --- the solved ILPs kept on disk (planner/solver/intra_op.py `_cache_path`) ---------------------

def test_a_solved_ilp_is_read_back_from_the_cache(gpt_block, tmp_path, monkeypatch):
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(intra_op, "TABLE_UP_TO", 0)  # a block goes to the ILP, as a larger unit would
    ops, _ = gpt_block
    problem = _problem(ops, 4)
    first = solve_intra_op(problem)
    (stored,) = (tmp_path / "intra_op").iterdir()
    solved = []
    real = intra_op._solve_ilp
    monkeypatch.setattr(intra_op, "_solve_ilp", lambda *a: solved.append(a) or real(*a))
    assert solve_intra_op(problem) == first and not solved  # read back, not solved again
    # Other collective times are another problem: solved, and kept beside the first.
    slower = IntraOpProblem(ops, 4, 2, 1 / 250e12, Ring(4, bandwidth=1e9))
    solve_intra_op(slower)
    assert len(solved) == 1 and len(list((tmp_path / "intra_op").iterdir())) == 2
    # A damaged file is ignored: the ILP is solved again and the file rewritten.
    stored.write_text("{not json")
    assert solve_intra_op(problem) == first and len(solved) == 2
    assert json.loads(stored.read_text()) == first.strategies


def test_an_empty_cache_variable_turns_the_cache_off(gpt_block, monkeypatch):
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, "")
    ops, _ = gpt_block
    problem = _problem(ops, 2)
    assert intra_op._cache_path(problem, intra_op._build_graph(problem)) is None


# --- presolve: strategies that dominate are fixed before the table or the ILP ----------------------

CHUNKED_SCAN = """
import torch
from torch import nn


class ChunkedScan(nn.Module):
    '''Linear attention computed chunk by chunk, as Qwen3-Next's gated delta rule is: a state carried
    from chunk to chunk makes each later product read every earlier one through elementwise ops.'''

    def __init__(self, width=64, heads=4, chunks=4):
        super().__init__()
        self.heads, self.chunks = heads, chunks
        self.norm = nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        state = torch.zeros(b, self.heads, d // self.heads, d // self.heads, device=x.device, dtype=x.dtype)
        outs = []
        for qc, kc, vc in zip(q.chunk(self.chunks, 2), k.chunk(self.chunks, 2), v.chunk(self.chunks, 2)):
            outs.append(qc @ state + (qc @ kc.transpose(-1, -2)).tril() @ vc)
            state = 0.9 * state + kc.transpose(-1, -2) @ vc
        return x + self.o(torch.cat(outs, 2).transpose(1, 2).reshape(b, s, d))


class Model(nn.Module):
    def __init__(self, seq_len=32):
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.block = ChunkedScan()
        self.head = nn.Linear(64, 128)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def build_model(seq_len=32):
    return Model(seq_len)


def make_batch(batch_size, seq_len=32):
    ids = torch.randint(0, 128, (batch_size, seq_len))
    return ids, ids
"""


@pytest.fixture(scope="module")
def scan_block(tmp_path_factory):
    path = tmp_path_factory.mktemp("scan") / "scan.py"
    path.write_text(CHUNKED_SCAN)
    prof = profile_model(str(path), {}, [1], device="meta")
    (block,) = [u for u in prof.units if u.name == "block"]
    return block


@pytest.mark.parametrize("bandwidth, flops", [(300e9, 250e12), (1e9, 1e15), (300e9, 1e9)])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("tp", [2, 16])
@pytest.mark.parametrize("block", ["gpt_block", "llama_block", "scan_block"])
def test_presolve_keeps_the_optimum(request, block, tp, sp, bandwidth, flops, monkeypatch):
    """Fixing dominant strategies (`_presolved`) loses nothing: the answer costs what CBC finds on
    the whole problem, for Megatron's blocks and a chunked scan, with sequence parallelism or not,
    at a degree that splits every head and one that does not split Llama's 8 key/value heads nor
    the scan's 4 (16), whose attention stays replicated."""
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, "")
    found = request.getfixturevalue(block)
    ops = tuple(found[0] if isinstance(found, tuple) else found.ops)
    mixes = not isinstance(found, tuple) and bool(found.mixes_tokens)
    problem = IntraOpProblem(ops, tp, tp, 1 / flops, Ring(tp, bandwidth), sequence_parallel=sp, mixes_tokens=mixes)
    graph = _build_graph(problem)
    free = {v: s for v, s in graph.nodes.items() if "fixed" not in s}
    whole = evaluate(problem, intra_op._solve_ilp(problem, graph, free))
    presolved = intra_op._solve(problem)
    assert presolved.compute_time_s + presolved.comm_time_s == pytest.approx(whole.compute_time_s + whole.comm_time_s, rel=1e-9)


def test_a_unit_sequence_parallelism_keeps_whole_is_decided_by_presolve(scan_block):
    """Under SP a unit that mixes tokens keeps every op replicated; its merge nodes (one per set of
    products a tensor combines: quadratic in the chunks) are then R at no cost, the one feeding the
    unit's sequence-sharded output too, so nothing is left to the table or CBC."""
    import planner.solver.intra_op as intra_op

    assert scan_block.mixes_tokens
    problem = IntraOpProblem(tuple(scan_block.ops), 2, 2, 1 / 250e12, Ring(2), sequence_parallel=True, mixes_tokens=True)
    graph = _build_graph(problem)
    merges = [v for v in graph.nodes if v.startswith("merge:")]
    assert len(merges) >= 4 and all(len(graph.nodes[v]) == 3 for v in merges)
    presolved = intra_op._presolved(problem, graph)
    undecided = [v for v, strategies in presolved.nodes.items() if len(strategies) > 1]
    assert undecided == []
    chosen = intra_op._solve(problem).strategies
    assert {chosen[op.name] for op in scan_block.ops} == {"replicate"}


def test_presolve_counts_a_conversion_another_reader_pays_anyway(scan_block, monkeypatch):
    """At a degree that does not split the scan's 4 heads (tp 8) its products stay replicated, and a
    merge or projection whose inputs other, decided readers convert anyway (Qwen3-Next's linear
    attention: 257 readers of one projection) costs nothing more replicated, so presolve decides
    it: before, 15 nodes went to the solver (Qwen3-Next's unit to CBC for 4 s at each of tp 2, 4
    and 8). The answer costs what CBC finds on the whole problem."""
    import planner.solver.intra_op as intra_op

    monkeypatch.setenv(intra_op.CACHE_ENV, "")
    problem = IntraOpProblem(tuple(scan_block.ops), 8, 8, 1 / 250e12, Ring(8), mixes_tokens=True)
    graph = _build_graph(problem)
    free = {v: s for v, s in graph.nodes.items() if "fixed" not in s}
    before = [v for v, strategies in free.items() if len(strategies) > 1]
    after = [v for v, strategies in intra_op._presolved(problem, graph).nodes.items() if len(strategies) > 1]
    assert len(before) == 15 and len(after) <= 8 and "q" in before and "q" not in after
    whole = evaluate(problem, intra_op._solve_ilp(problem, graph, free))
    presolved = intra_op._solve(problem)
    assert presolved.compute_time_s + presolved.comm_time_s == pytest.approx(whole.compute_time_s + whole.comm_time_s, rel=1e-9)


def test_a_merge_of_thousands_of_products_has_a_short_name_of_its_own():
    """A scan written as a Python loop combines every earlier step's product (Jamba's Mamba at 4096
    tokens); its merge nodes are named in a few dozen characters, one name per set of sources."""
    from planner.solver.intra_op import _merge_name

    many = sorted(f"matmul_{i}" for i in range(5000))
    assert len(_merge_name(many)) < 80
    assert _merge_name(many) != _merge_name(many[:-1]) != _merge_name(many[1:])
    assert _merge_name(["k", "q"]) == "merge:k+q"


@pytest.mark.parametrize("block", ["gpt_block", "scan_block"])
def test_a_graph_built_once_prices_every_micro_batch_alike(request, block):
    """`evaluate` on the unit-scale graph scaled to a micro-batch (planner/solver/costs.py keeps one
    per structure) prices exactly as on a graph built at that micro-batch."""
    from planner.solver.intra_op import unit_scale_graph

    found = request.getfixturevalue(block)
    ops = tuple(found[0] if isinstance(found, tuple) else found.ops)
    problem = _problem(ops, 2)
    chosen = solve_intra_op(problem).strategies
    for scale in (0.5, 3.0, 7.0):
        scaled = dataclasses.replace(problem, activation_scale=scale)
        built, reused = evaluate(scaled, chosen), evaluate(scaled, chosen, unit_scale_graph(scaled))
        assert reused == built


@pytest.mark.parametrize("tp", [2, 4])
def test_float8_inputs_gathered_in_fp8_under_sequence_parallelism(llama_block, tp):
    # torchtitan's Float8 TP (torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput) casts the
    # sequence-sharded input of an FP8 linear before gathering it: those forward all-gathers move
    # half the bytes; reductions and the backward do not change.
    from planner.cost.fp8 import FP8_ALL_GATHER_BYTES_FACTOR

    ops, _ = llama_block
    linears = frozenset(op.name for op in ops if op.kind == "linear")
    bf16 = _problem(ops, tp, sequence_parallel=True)
    fp8 = dataclasses.replace(bf16, fp8_gathered_ops=linears)
    chosen = solve_intra_op(fp8)
    assert chosen.comm_time_s <= solve_intra_op(bf16).comm_time_s
    # The ILP prices what `evaluate` prices.
    assert evaluate(fp8, chosen.strategies).comm_time_s == pytest.approx(chosen.comm_time_s)
    # Against the same layout in bf16: the forward all-gathers, at half the bytes, and nothing else.
    graph, ring = _build_graph(fp8), Ring(tp)
    gathers = [c.split()[-1] for c in chosen.collectives if c.startswith("fwd S->R")]
    assert gathers and set(gathers) <= graph.fp8_sources
    saved = sum(ring.all_gather_s(graph.nbytes[g]) - ring.all_gather_s(graph.nbytes[g] * FP8_ALL_GATHER_BYTES_FACTOR)
                for g in gathers)
    plain = evaluate(bf16, chosen.strategies)
    assert chosen.comm_time_s == pytest.approx(plain.comm_time_s - saved)
    assert chosen.forward_comm_time_s == pytest.approx(plain.forward_comm_time_s - saved)
    # A tensor a bf16 op also reads is gathered in bf16.
    assert "merge:feed_forward.w1+feed_forward.w3" not in _build_graph(
        dataclasses.replace(bf16, fp8_gathered_ops=linears - {"feed_forward.w2"})).fp8_sources


def test_torchtitan_float8_under_tp_gathers_fp8():
    from planner.engines import torchtitan

    float8 = '\n[model]\nconverters = ["float8"]\n'
    assert torchtitan.parse("[parallelism]\ntensor_parallel_degree = 4\n" + float8).float8_tp_gather
    assert not torchtitan.parse("[parallelism]\ntensor_parallel_degree = 4\n").float8_tp_gather  # bf16
    assert not torchtitan.parse("[parallelism]\ndata_parallel_shard_degree = 8\n" + float8).float8_tp_gather  # no TP
    # Compiled, a block at a time: the Float8 casts of a shared input are one (planner/cost/fp8.py, Casts).
    assert torchtitan.parse("[compile]\nenable = true\n" + float8).float8_shared_casts
    assert not torchtitan.parse(float8).float8_shared_casts  # eager
    assert not torchtitan.parse("[compile]\nenable = true\n").float8_shared_casts  # bf16
    assert not torchtitan.parse('[compile]\nenable = true\ncomponents = ["loss"]\n' + float8).float8_shared_casts
