"""Memory model: Korthikanti et al. 2022 activation formulas and ZeRO's 16 bytes per parameter."""

import pytest

from planner.cost.memory import korthikanti_layer_bytes, model_state_bytes, unit_activation_bytes

# GPT-3 175B layer shape (Brown et al. 2020) with Korthikanti's parallel setting t = 8.
S, B, H, A, T = 2048, 1, 12288, 96, 8


def _gpt_layer(tp, sp, recompute):
    """Our memory model fed Korthikanti's own accounting of one layer (16-bit activations)."""
    sbh = S * B * H
    return unit_activation_bytes(
        saved_bytes=34 * sbh + 5 * A * S * S * B,
        output_bytes=2 * sbh,
        input_bytes=2 * sbh,
        attention_score_bytes=5 * A * S * S * B,
        tp_degree=tp,
        sequence_parallel=sp,
        recompute=recompute,
    ).stored


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_memory_reproduces_korthikanti_table2(tp, sp, recompute):
    if sp and tp == 1:
        pytest.skip("sequence parallelism needs a TP group")
    assert _gpt_layer(tp, sp, recompute) == pytest.approx(korthikanti_layer_bytes(S, B, H, A, tp, sp, recompute), rel=1e-12)


def test_korthikanti_closed_forms_by_hand():
    sbh = S * B * H
    # Equation (1): no parallelism, sbh(34 + 5as/h).
    assert korthikanti_layer_bytes(S, B, H, A) == sbh * (34 + 5 * A * S / H)
    # Equation (2): TP, sbh(10 + 24/t + 5as/(ht)).
    assert korthikanti_layer_bytes(S, B, H, A, T) == pytest.approx(sbh * (10 + 24 / T + 5 * A * S / (H * T)))
    # Equation (4): TP + SP, sbh/t (34 + 5as/h).
    assert korthikanti_layer_bytes(S, B, H, A, T, sp=True) == pytest.approx(sbh / T * (34 + 5 * A * S / H))
    # Selective recomputation with SP: 34 sbh / t; full recomputation keeps only the 2sbh input.
    assert korthikanti_layer_bytes(S, B, H, A, T, sp=True, recompute="selective") == pytest.approx(34 * sbh / T)
    assert korthikanti_layer_bytes(S, B, H, A, T, recompute="full") == 2 * sbh


def test_numbers_from_the_paper():
    # Section 4.1 example: GPT-3 175B layer at t = 8 without SP or recomputation,
    # sbh(10 + 24/8 + 5*96*2048/(12288*8)) = sbh * 23 bytes = 579 MB per layer.
    assert korthikanti_layer_bytes(S, B, H, A, T) == pytest.approx(S * B * H * 23.0)


def test_full_recompute_keeps_a_transient_of_one_unit():
    sbh = S * B * H
    act = unit_activation_bytes(34 * sbh, 2 * sbh, 2 * sbh, 0.0, 1, False, "full")
    assert act.stored == 2 * sbh and act.transient == 34 * sbh


def test_replicated_unit_is_not_divided():
    act = unit_activation_bytes(1000.0, 10.0, 10.0, 0.0, 4, True, "none", sharded=False)
    assert act.stored == 1000.0


def test_mixed_precision_adam_is_16_bytes_per_parameter_without_zero():
    n = 1_000_000
    assert model_state_bytes(n, "bfloat16", 0, 8).total == 16 * n
    assert model_state_bytes(n, "float32", 0, 8).total == 16 * n


@pytest.mark.parametrize("zero,expected", [(0, 16), (1, 2 + 2 + 12 / 8), (2, 2 + (2 + 12) / 8), (3, 16 / 8)])
def test_zero_stages_divide_states_by_dp(zero, expected):
    # ZeRO paper, Figure 1: Psi(2 + 2 + K/N_d), Psi(2 + (2 + K)/N_d), Psi(16)/N_d with K = 12.
    assert model_state_bytes(1.0, "bfloat16", zero, 8).total == pytest.approx(expected)


def test_unknown_recompute_is_rejected():
    with pytest.raises(ValueError, match="recompute"):
        unit_activation_bytes(1.0, 1.0, 1.0, 0.0, 1, False, "sometimes")
