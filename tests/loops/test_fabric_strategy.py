"""``DynaTrainFabricStrategy`` and ``FabricLibrary`` without processes: settings, precision, refusals."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import Precision

from lightning_dynatrain.fabric import DynaTrainEngine as FabricEngine
from lightning_dynatrain.fabric import DynaTrainFabricStrategy, FabricSetupError
from lightning_dynatrain.fabric.library import FabricLibrary
from lightning_dynatrain.loop.engine import LoopSetupError, _settings_of
from lightning_dynatrain.loop.library import as_library
from lightning_dynatrain.runtime.settings import DynaTrainSettings
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig


def test_settings_are_parsed_into_the_strategys_settings() -> None:
    strategy = DynaTrainFabricStrategy(layout="dp2-tp2-pp1", schedule="3:dp4", staging_budget="64MiB")
    assert strategy.settings == DynaTrainSettings(layout="dp2-tp2-pp1", schedule={3: "dp4"}, staging_budget=64 << 20)
    assert strategy.settings.schedule == ((3, ParallelConfig(dp=4)),)
    assert repr(strategy).startswith("DynaTrainFabricStrategy(DynaTrainSettings(dp2-tp2-pp1, 3:dp4-tp1-pp1")
    settings = DynaTrainSettings(layout="dp4")
    assert DynaTrainFabricStrategy(settings).settings is settings


def test_settings_and_values_together_or_a_bad_setting_are_refused() -> None:
    with pytest.raises(FabricSetupError, match=r"got settings and the values \['layout'\]"):
        DynaTrainFabricStrategy(DynaTrainSettings(), layout="dp2")
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


def test_the_library_needs_the_strategy_and_a_launched_fabric() -> None:
    with pytest.raises(FabricSetupError, match="Fabric runs DDPStrategy.*HINT: build Fabric\\(strategy=DynaTrain"):
        FabricLibrary(Fabric(accelerator="cpu", devices=1, strategy="ddp"))
    with pytest.raises(FabricSetupError, match="has not been launched.*HINT: call fabric.launch\\(\\)"):
        FabricEngine(Fabric(accelerator="cpu", devices=1, strategy=DynaTrainFabricStrategy()), recipe=None,
                     adam=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a LoopLibrary, not object.*HINT: build the engine with "
                                        "lightning_dynatrain.accelerate.DynaTrainEngine"):
        as_library(object())


class _LibraryWithSettings:
    name = "Fabric"

    def __init__(self, settings: DynaTrainSettings | None) -> None:
        self.settings = settings


def test_the_engines_settings_come_from_the_library_or_the_argument_never_two_different_ones() -> None:
    held, given = DynaTrainSettings(layout="dp2"), DynaTrainSettings(layout="dp4")
    assert _settings_of(_LibraryWithSettings(held), None) is held
    assert _settings_of(_LibraryWithSettings(held), DynaTrainSettings(layout="dp2")) is held
    assert _settings_of(_LibraryWithSettings(None), given) is given
    assert _settings_of(_LibraryWithSettings(None), None) == DynaTrainSettings()
    with pytest.raises(LoopSetupError, match="HINT: pass the layout, schedule and budgets to the Fabric strategy only"):
        _settings_of(_LibraryWithSettings(held), given)


def test_the_engine_takes_the_optimizers_settings_once() -> None:
    """``optimizer=`` (megatron's OptimizerConfig or AdamSettings) or ``adam=``: refused before anything is set up."""
    from lightning_dynatrain.loop import DynaTrainEngine
    from lightning_dynatrain.runtime.recipe import AdamSettings

    with pytest.raises(LoopSetupError, match="neither optimizer= nor adam= was given"):
        DynaTrainEngine(object(), recipe=None)  # type: ignore[arg-type]
    with pytest.raises(LoopSetupError, match="both optimizer= and adam="):
        DynaTrainEngine(object(), recipe=None, optimizer=AdamSettings(lr=1e-3),  # type: ignore[arg-type]
                        adam=AdamSettings(lr=1e-3))
