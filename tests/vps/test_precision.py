"""Which state kinds a parameter has, by its params' dtype and the optimizer."""

from __future__ import annotations

import pytest

from lightning_dynatrain.vps.spec import Group, LogicalTensor, Place, Precision, StateKind

NORM = LogicalTensor("final_norm.weight", (8,), ("",), Group.DENSE, Place.LAST, "final_norm.weight", always_fp32=True)


@pytest.mark.parametrize("precision, kinds", [
    (Precision.FP32, [("param", 4), ("exp_avg", 4), ("exp_avg_sq", 4)]),
    (Precision.BF16, [("param", 2), ("main_param", 4), ("exp_avg", 4), ("exp_avg_sq", 4)]),
    (Precision.FP32_SGD, [("param", 4), ("momentum_buffer", 4)]),
    (Precision.BF16_SGD, [("param", 2), ("main_param", 4), ("momentum_buffer", 4)]),
])
def test_kinds_follow_the_params_and_the_optimizer(precision: Precision, kinds: list) -> None:
    assert [(k.value, b) for k, b in precision.kinds] == kinds
    assert Precision.of_state(params=precision.params, optimizer=precision.optimizer) is precision


def test_a_tensor_kept_in_fp32_keeps_its_optimizers_state() -> None:
    assert Precision.BF16_SGD.of(NORM) is Precision.FP32_SGD and Precision.BF16.of(NORM) is Precision.FP32
    assert Precision.BF16_SGD.dtype_name(StateKind.PARAM, NORM) == "float32"
    assert [k for k, _ in Precision.BF16_SGD.kinds_of(NORM)] == [StateKind.PARAM, StateKind.MOMENTUM]
    assert StateKind.MOMENTUM.is_optimizer_state and not StateKind.MAIN_PARAM.is_optimizer_state


def test_zero1_takes_adam_only() -> None:
    from megatron.core.optimizer import OptimizerConfig

    from lightning_dynatrain.runtime.layout_checks import validate_optimizer
    from lightning_dynatrain.vps.errors import LayoutError
    from lightning_dynatrain.vps.layout import ParallelConfig

    validate_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), ParallelConfig.parse("dp2"))
    validate_optimizer(OptimizerConfig(optimizer="adam", lr=0.1), ParallelConfig.parse("dp2-zero1"))
    with pytest.raises(LayoutError, match="zero1.*takes Adam only.*trains with sgd.*drop -zero1"):
        validate_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), ParallelConfig.parse("dp2-zero1"))
