"""The layout policy of a new world: a user's map (Python or YAML) or ``auto``; and the launchers
an elastic fit refuses."""

from __future__ import annotations

import pytest

from lightning_dynatrain.elastic.driver.layout_policy import (
    StepModel,
    candidate_layouts,
    choose_layout,
    moved_bytes,
    parse_policy,
    rank_state_bytes,
)
from lightning_dynatrain.megatron.gpt import GPTShape, logical_spec
from lightning_dynatrain.runtime.layout_checks import BatchSizeError
from lightning_dynatrain.vps.dryrun import LinkModel
from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.spec import Precision

SHAPE = GPTShape(hidden=32, layers=6, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32)
DP2 = ParallelConfig.parse("dp2-tp1-pp1")


def _choose(policy, world, shape=SHAPE, global_batch=12, **kwargs):
    return choose_layout(parse_policy(policy), world=world, source=shape, global_batch_size=global_batch,
                         micro_batch_size=1, current=DP2, **kwargs)


def test_a_map_gives_each_world_its_layout_from_python_or_yaml(tmp_path):
    mapping = {2: "dp2-tp1-pp1", 3: "dp3-tp1-pp1", 4: "dp2-tp2-pp1"}
    path = tmp_path / "layouts.yaml"
    path.write_text("layouts:\n  2: dp2-tp1-pp1\n  3: dp3-tp1-pp1\n  4: dp2-tp2-pp1\n")
    for policy in (mapping, str(path)):
        assert [str(_choose(policy, w).layout) for w in (2, 3, 4)] == ["dp2-tp1-pp1", "dp3-tp1-pp1", "dp2-tp2-pp1"]
    assert "map gives dp3-tp1-pp1" in _choose(mapping, 3).reason


def test_a_map_without_the_world_or_with_a_layout_of_another_size_is_refused():
    with pytest.raises(LayoutError, match=r"no layout for a world of 5 processes \(it has \[2, 3\]\)"):
        _choose({2: "dp2", 3: "dp3"}, 5)
    with pytest.raises(LayoutError, match="maps world sizes to layouts of other sizes"):
        parse_policy({4: "dp2-tp1-pp1"})
    with pytest.raises(BatchSizeError, match="global batch 6 is not a multiple"):
        _choose({4: "dp4-tp1-pp1"}, 4, global_batch=6)  # the policy never changes the global batch
    # YAML reads "{2:dp2-tp1-pp1}" (no space after the colon) as a string: not a file either
    with pytest.raises(LayoutError, match="is not 'auto', a map or a YAML file that exists"):
        parse_policy("{2:dp2-tp1-pp1,4:dp2-tp2-pp1}")


def test_auto_picks_a_valid_layout_and_says_why():
    for world in (2, 3, 4, 6):
        choice = _choose("auto", world)
        assert choice.layout.world_size == world and choice.layout in candidate_layouts(world, DP2)
        assert 12 % (choice.layout.dp * 1) == 0 and 4 % choice.layout.tp == 0 and 6 % choice.layout.pp == 0
        assert choice.reason.startswith(f"auto: {choice.layout} has the shortest modelled step")


def test_auto_breaks_ties_by_the_fewest_moved_bytes():
    free = StepModel(links=LinkModel(intra_node=1e30, inter_node=1e30, local_copy=1e30))
    current = ParallelConfig.parse("dp1-tp1-pp2")
    choice = choose_layout("auto", world=2, source=SHAPE, global_batch_size=12, micro_batch_size=1, current=current,
                           model=free)  # no communication cost: dp2 and tp2 tie (pp2 has a bubble)
    spec = logical_spec(SHAPE)
    moves = {lay: moved_bytes(spec, current, ParallelConfig.parse(lay), Precision.FP32, None)
             for lay in ("dp2-tp1-pp1", "dp1-tp2-pp1")}
    assert moves["dp2-tp1-pp1"] != moves["dp1-tp2-pp1"]
    assert str(choice.layout) == min(moves, key=moves.get)
    assert "tied within 1% with 1; it moves the fewest bytes" in choice.reason


def test_auto_refuses_a_world_no_layout_fits_with_every_reason():
    shape = GPTShape(hidden=32, layers=4, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32)
    with pytest.raises(LayoutError, match="no layout of 3 processes fits") as err:
        _choose("auto", 3, shape=shape, global_batch=8)
    assert "dp3-tp1-pp1" in str(err.value) and "dp1-tp3-pp1" in str(err.value) and "dp1-tp1-pp3" in str(err.value)


def test_auto_keeps_only_layouts_whose_state_fits_memory():
    spec = logical_spec(SHAPE)
    limit = rank_state_bytes(ParallelConfig.parse("dp2-tp1-pp2"), spec, Precision.FP32)
    assert rank_state_bytes(ParallelConfig.parse("dp4-tp1-pp1"), spec, Precision.FP32) > limit
    choice = _choose("auto", 4, memory_per_rank=limit)
    assert rank_state_bytes(choice.layout, spec, Precision.FP32) <= limit
    with pytest.raises(LayoutError, match="GiB a rank"):
        _choose("auto", 4, memory_per_rank=1)


def test_auto_weighs_virtual_stages_smaller_bubble_against_their_transfers():
    """Under a memory bound only pipelined layouts meet (tp4 does not divide 2 heads), two virtual
    stages win where transfers cost nothing (half the bubble) and lose where they are slow (twice
    the transfers); the state a rank holds is the same with or without them."""
    shape = GPTShape(hidden=32, layers=8, heads=2, ffn_hidden=64, vocab_size=256, seq_length=32)
    spec = logical_spec(shape)
    limit = rank_state_bytes(ParallelConfig.parse("dp1-tp1-pp4"), spec, Precision.FP32)
    assert rank_state_bytes(ParallelConfig.parse("dp1-tp1-pp4-vpp2"), spec, Precision.FP32) == limit
    free = StepModel(links=LinkModel(intra_node=1e30, inter_node=1e30, local_copy=1e30))
    slow = StepModel(links=LinkModel(intra_node=1e6, inter_node=1e6, local_copy=1e9))
    chosen = {name: _choose("auto", 4, shape=shape, global_batch=8, memory_per_rank=limit, model=model)
              for name, model in (("free", free), ("slow", slow))}
    assert str(chosen["free"].layout) == "dp1-tp2-pp2-vpp2" and "dp1-tp2-pp2 1.06x" in chosen["free"].reason
    assert str(chosen["slow"].layout) == "dp1-tp1-pp4" and "dp1-tp1-pp4-vpp2 2.00x" in chosen["slow"].reason


def test_an_elastic_fit_refuses_lightnings_own_launcher_with_more_than_one_process():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_dynatrain.launch_environment import LauncherError
    from lightning_dynatrain.strategy.dynatrain import DynaTrainStrategy
    from lightning_dynatrain.strategy.elastic_front import LightningFront

    env = LightningEnvironment()
    env.set_world_size(2)
    strategy = DynaTrainStrategy("dp2", cluster_environment=env)
    with pytest.raises(LauncherError, match="launch with torchrun or srun"):
        LightningFront(strategy).launch()
