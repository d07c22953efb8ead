"""ScheduledReconfig's schedule: the three ways to write it, and the checks every entry passes at setup."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dynatrain.callbacks import ScheduledReconfig, ScheduleError, parse_schedule, validate_schedule
from lightning_dynatrain.megatron.gpt import GPTShape
from lightning_dynatrain.vps.layout import ParallelConfig

SHAPE = GPTShape(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=32,
                 make_vocab_size_divisible_by=128)
P = ParallelConfig.parse


def test_dict_string_and_yaml_give_the_same_sorted_schedule(tmp_path: Path) -> None:
    expected = {200: P("dp1-tp2-pp2"), 400: P("dp4")}
    assert parse_schedule({400: "dp4-tp1-pp1", 200: P("dp1-tp2-pp2")}) == expected
    assert list(parse_schedule(" 400:dp4 , 200:tp2-pp2-dp1 ,")) == [200, 400]
    assert parse_schedule("400:dp4,200:dp1-tp2-pp2") == expected
    yaml = tmp_path / "sched.yaml"
    yaml.write_text("schedule:\n  200: dp1-tp2-pp2\n  400: dp4-tp1-pp1\n")
    assert parse_schedule(str(yaml)) == expected
    assert parse_schedule(yaml) == expected
    bare = tmp_path / "bare.yml"
    bare.write_text("{200: dp1-tp2-pp2, '400': dp4}\n")
    assert parse_schedule(bare) == expected
    assert parse_schedule(None) == parse_schedule("") == parse_schedule({}) == {}
    assert ScheduledReconfig("0:dp2").schedule == {0: P("dp2")}


@pytest.mark.parametrize("schedule, words", [
    ("200-dp2", ["has no ':'", "STEP:LAYOUT"]),
    ("x:dp2", ["step 'x' is not a whole number"]),
    ("-5:dp2", ["step -5 is negative"]),
    ("5:dp2,5:dp4", ["step 5 appears twice"]),
    ("5:dp2,9:dq4", ["entry at step 9", "unknown part 'dq4'", "HINT"]),
    ({3: "dp2-tp0"}, ["entry at step 3", "tp=0"]),
    ("missing.yaml", ["schedule file missing.yaml does not exist"]),
    (3.5, ["cannot read a schedule from float"]),
])
def test_unreadable_schedules_name_the_problem(schedule, words) -> None:
    with pytest.raises(ScheduleError) as err:
        parse_schedule(schedule)
    for word in words:
        assert word in str(err.value)


def test_yaml_without_a_mapping_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("schedule: [1, 2]\n")
    with pytest.raises(ScheduleError, match="no mapping of steps to layouts"):
        parse_schedule(path)


def test_the_first_bad_entry_fails_naming_its_step_and_rule() -> None:
    schedule = parse_schedule({100: "dp2-tp2", 5000: "dp1-tp4-pp1", 6000: "dp1-tp1-pp4"})
    validate_schedule(schedule, world_size=4)  # world size alone: fine
    with pytest.raises(ScheduleError) as err:
        validate_schedule(schedule, world_size=4, model=GPTShape(**{**_fields(SHAPE), "heads": 2}))
    assert "step 5000 (dp1-tp4-pp1)" in str(err.value) and "tp=4 must divide the 2 attention heads" in str(err.value)
    with pytest.raises(ScheduleError, match=r"step 6000 \(dp1-tp1-pp4\).*pp=4 must divide the 2 layers"):
        validate_schedule(schedule, world_size=4, model=SHAPE)


def test_another_world_size_needs_the_elastic_device_manager() -> None:
    with pytest.raises(ScheduleError) as err:
        validate_schedule(parse_schedule("50:dp8"), world_size=4, start=P("dp4"))
    text = str(err.value)
    assert "step 50" in text and "needs dp*tp*pp*cp = 8 processes but the job runs 4 (now dp4-tp1-pp1)" in text
    assert "Elastic Device Manager" in text and "HINT: choose a layout whose dp*tp*pp*cp is 4" in text


def test_batch_rule_and_vocabulary_padding_warning() -> None:
    with pytest.raises(ScheduleError, match=r"step 9 .* global batch 8 is not a multiple of dp \* micro_batch_size = 4 \* 4"):
        validate_schedule(parse_schedule("9:dp4"), world_size=4, model=SHAPE, global_batch_size=8, micro_batch_size=4)
    padded_by_tp = GPTShape(**{**_fields(SHAPE), "make_vocab_size_divisible_by": 256})  # 256 at tp1, 512 at tp2
    with pytest.warns(UserWarning, match="padded vocabulary differs"):
        validate_schedule(parse_schedule("9:dp2-tp2"), world_size=4, start=P("dp4"), model=padded_by_tp)


def test_state_dict_round_trip() -> None:
    cb = ScheduledReconfig("10:dp2-tp2,20:dp4")
    cb.driver.done = {10}
    other = ScheduledReconfig("10:dp2-tp2,20:dp4")
    other.load_state_dict(cb.state_dict())
    assert other.done == {10} and cb.state_key == other.state_key != ScheduledReconfig("10:dp4").state_key


def _fields(shape: GPTShape) -> dict:
    return {f: getattr(shape, f) for f in shape.__dataclass_fields__}
