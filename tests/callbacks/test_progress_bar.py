"""``LayoutProgressBar``'s postfix: the layout once the strategy has one, the last switch once one ran."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_dynatrain.callbacks import LayoutProgressBar
from lightning_dynatrain.runtime.reconfig_report import ReconfigReport
from lightning_dynatrain.vps.layout import ParallelConfig


def _trainer(strategy) -> SimpleNamespace:
    return SimpleNamespace(loggers=[], progress_bar_metrics={"train/loss": 4.25}, strategy=strategy)


def test_postfix_names_the_layout_and_the_last_switch() -> None:
    bar = LayoutProgressBar()
    strategy = SimpleNamespace(run=SimpleNamespace(layout_or_none=ParallelConfig.parse("dp2-tp2-pp1")), switch_history=[])
    assert bar.get_metrics(_trainer(strategy), None) == {"train/loss": 4.25, "layout": "dp2-tp2-pp1"}
    strategy.switch_history = [ReconfigReport(step=3, src="dp4-tp1-pp1", dst="dp2-tp2-pp1", seconds=0.1234)]
    assert bar.get_metrics(_trainer(strategy), None)["switch"] == "0.12s"


def test_under_another_strategy_it_is_the_plain_bar() -> None:
    assert LayoutProgressBar().get_metrics(_trainer(SimpleNamespace()), None) == {"train/loss": 4.25}
