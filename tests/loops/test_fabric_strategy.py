"""``DynaTrainFabricStrategy`` and ``FabricHost`` without processes: settings, precision, refusals."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import Precision

from lightning_dynatrain.accelerate import DynaTrainPlugin
from lightning_dynatrain.fabric import DynaTrainFabricStrategy, FabricSetupError
from lightning_dynatrain.fabric.host import FabricHost
from lightning_dynatrain.loop.engine import LoopSetupError, _plugin_of
from lightning_dynatrain.loop.host import as_host
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig


def test_settings_are_parsed_into_the_strategys_plugin() -> None:
    strategy = DynaTrainFabricStrategy(layout="dp2-tp2-pp1", schedule="3:dp4", staging_budget="64MiB")
    assert strategy.plugin == DynaTrainPlugin(layout="dp2-tp2-pp1", schedule={3: "dp4"}, staging_budget=64 << 20)
    assert strategy.plugin.schedule == ((3, ParallelConfig(dp=4)),)
    assert repr(strategy).startswith("DynaTrainFabricStrategy(DynaTrainPlugin(dp2-tp2-pp1, 3:dp4-tp1-pp1")
    plugin = DynaTrainPlugin(layout="dp4")
    assert DynaTrainFabricStrategy(plugin).plugin is plugin


def test_a_plugin_and_settings_together_or_a_bad_setting_are_refused() -> None:
    with pytest.raises(FabricSetupError, match=r"got a plugin and settings \['layout'\]"):
        DynaTrainFabricStrategy(DynaTrainPlugin(), layout="dp2")
    with pytest.raises(LayoutError):
        DynaTrainFabricStrategy(layout="dp2-tq2")


@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-true", torch.bfloat16),
                                                  ("bf16-mixed", torch.bfloat16)])
def test_fabric_precision_chooses_megatrons_params_dtype_and_fabric_applies_no_context(precision: str,
                                                                                       dtype: torch.dtype) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision, strategy=DynaTrainFabricStrategy())
    assert fabric.strategy.params_dtype == dtype
    assert type(fabric._precision) is Precision  # no autocast, no default-dtype context around the megatron step


def test_a_precision_megatron_does_not_take_here_is_refused_with_the_ones_it_does() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true", strategy=DynaTrainFabricStrategy())
    with pytest.raises(FabricSetupError, match=r"precision='64-true'.*HINT: use precision=\"32-true\""):
        fabric.strategy.params_dtype


def test_the_strategy_wraps_nothing_and_adds_no_distributed_sampler() -> None:
    strategy = DynaTrainFabricStrategy()
    assert strategy.distributed_sampler_kwargs is None
    with pytest.raises(FabricSetupError, match="sets up a DynaTrainEngine's model, not a Linear"):
        strategy.setup_module(torch.nn.Linear(2, 2))


def test_the_host_needs_the_strategy_and_a_launched_fabric() -> None:
    with pytest.raises(FabricSetupError, match="Fabric runs DDPStrategy.*HINT: build Fabric\\(strategy=DynaTrain"):
        FabricHost(Fabric(accelerator="cpu", devices=1, strategy="ddp"))
    with pytest.raises(FabricSetupError, match="has not been launched.*HINT: call fabric.launch\\(\\)"):
        as_host(Fabric(accelerator="cpu", devices=1, strategy=DynaTrainFabricStrategy()))
    with pytest.raises(TypeError, match="needs an Accelerator, a Fabric or a LoopHost, not object"):
        as_host(object())


class _HostWithSettings:
    name = "Fabric"

    def __init__(self, plugin: DynaTrainPlugin | None) -> None:
        self.plugin = plugin


def test_the_engines_settings_come_from_the_host_or_the_argument_never_two_different_ones() -> None:
    held, given = DynaTrainPlugin(layout="dp2"), DynaTrainPlugin(layout="dp4")
    assert _plugin_of(_HostWithSettings(held), None) is held
    assert _plugin_of(_HostWithSettings(held), DynaTrainPlugin(layout="dp2")) is held
    assert _plugin_of(_HostWithSettings(None), given) is given
    assert _plugin_of(_HostWithSettings(None), None) == DynaTrainPlugin()
    with pytest.raises(LoopSetupError, match="HINT: pass the layout, schedule and budgets to the Fabric strategy only"):
        _plugin_of(_HostWithSettings(held), given)


def test_the_engine_takes_the_optimizers_settings_once() -> None:
    """``optimizer=`` (megatron's OptimizerConfig or AdamSettings) or ``adam=``: refused before anything is set up."""
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.strategy import AdamSettings

    with pytest.raises(LoopSetupError, match="neither optimizer= nor adam= was given"):
        DynaTrainEngine(object(), recipe=None)  # type: ignore[arg-type]
    with pytest.raises(LoopSetupError, match="both optimizer= and adam="):
        DynaTrainEngine(object(), recipe=None, optimizer=AdamSettings(lr=1e-3),  # type: ignore[arg-type]
                        adam=AdamSettings(lr=1e-3))
