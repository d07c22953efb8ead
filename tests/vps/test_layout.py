import pytest
from hypothesis import given, strategies as st

from lightning_dynatrain.vps.errors import LayoutError
from lightning_dynatrain.vps.layout import DenseCoord, ExpertCoord, ParallelConfig
from lightning_dynatrain.vps.presets import preset
from lightning_dynatrain.vps.validate import nearest_layouts, validate_layout


@given(dp=st.integers(1, 16), tp=st.integers(1, 8), pp=st.integers(1, 8), cp=st.sampled_from([1, 2]),
       zero=st.sampled_from([0, 1]), first=st.none() | st.integers(1, 9), last=st.none() | st.integers(1, 9))
def test_string_form_round_trips(dp, tp, pp, cp, zero, first, last):
    if pp == 1:
        first = last = None
    layout = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, first=first, last=last)
    assert ParallelConfig.parse(str(layout)) == layout
    assert str(ParallelConfig.parse(str(layout))) == str(layout)


def test_expert_fields_print_only_when_they_differ():
    layout = ParallelConfig.parse("dp4-tp2-pp1-ep4-etp1-zero1")
    assert (layout.ep, layout.etp, layout.edp, layout.zero) == (4, 1, 2, 1)
    assert str(layout) == "dp4-tp2-pp1-ep4-etp1-zero1"
    assert str(ParallelConfig.parse("ep2-tp2-dp2")) == "dp2-tp2-pp1-ep2"
    assert ParallelConfig.parse("dp2-tp2").etp == 2


@pytest.mark.parametrize("text, fragment", [
    ("dp2-tq2", "unknown part 'tq2'"),
    ("dp2-dp2", "dp is given twice"),
    ("dp0-tp1", "dp=0 is not a positive integer"),
    ("", "cannot parse layout"),
    ("dp2-zero3", "zero=3 is not supported"),
    ("dp1-tp1-ep2", "etp*ep = 1*2 must divide tp*cp*dp = 1"),
    ("dp2-tp2-etp1", "differs from tp=2 without expert parallelism"),
    ("dp2-tp1-pp1-first1", "first1 needs a pipeline: pp is 1"),
    ("dp1-tp1-pp2-last0", "last=0: a stage holds at least one layer"),
])
def test_malformed_layouts_name_the_problem(text, fragment):
    with pytest.raises(LayoutError) as err:
        ParallelConfig.parse(text)
    assert fragment in str(err.value)
    assert "HINT" in str(err.value)


def test_rank_coordinates_match_megatron_rank_generator():
    # megatron's own RankGenerator (pure python) builds the groups parallel_state uses
    from megatron.core.parallel_state import RankGenerator

    for text in ["dp2-tp2-pp2", "dp4-tp1-pp2-cp2", "dp2-tp4-pp1-ep4-etp2", "dp2-tp2-pp2-ep2-etp1"]:
        layout = ParallelConfig.parse(text)
        dense = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
        for token, field in (("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("cp", "cp")):
            for group in dense.get_ranks(token):
                coords = [layout.dense_coord(r) for r in group]
                others = {c._replace(**{field: 0}) for c in coords}
                assert len(others) == 1, f"{text}: megatron {token} group {group} is not one line of our mesh"
                assert [getattr(c, field) for c in coords] == list(range(len(group)))
        expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
        for token, field in (("tp", "etp"), ("ep", "ep"), ("dp", "edp")):
            for group in expert.get_ranks(token):
                coords = [layout.expert_coord(r) for r in group]
                assert len({c._replace(**{field: 0}) for c in coords}) == 1
                assert [getattr(c, field) for c in coords] == list(range(len(group)))
        for r in range(layout.world_size):
            assert layout.dense_rank(layout.dense_coord(r)) == r
            assert layout.expert_rank(layout.expert_coord(r)) == r


def test_dp_cp_index_orders_cp_fastest():
    layout = ParallelConfig.parse("dp2-tp1-pp1-cp2")
    assert [layout.dp_cp_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert layout.dense_coord(1) == DenseCoord(tp=0, cp=1, dp=0, pp=0)
    assert ParallelConfig.parse("dp2-tp2-ep2-etp1").expert_coord(3) == ExpertCoord(etp=0, ep=1, edp=1, pp=0)


def test_validation_names_every_broken_rule_and_suggests_fits():
    spec = preset("llama2-70b")
    with pytest.raises(LayoutError) as err:
        validate_layout(ParallelConfig.parse("dp2-tp16-pp3"), spec, world_size=64)
    message = str(err.value)
    assert "tp=16 must divide the 8 query groups" in message
    assert "pp=3 must divide the 80 layers" in message
    assert "must equal the world size 64" in message
    assert "nearest valid layouts for 64 ranks" in message
    for near in nearest_layouts(ParallelConfig.parse("dp2-tp16-pp3"), spec, 64):
        assert validate_layout(near, spec, world_size=64) is near


def test_expert_layout_checks():
    spec = preset("qwen-moe-235b")
    validate_layout(ParallelConfig.parse("dp128-tp4-pp2-ep64-zero1"), spec, world_size=1024)
    with pytest.raises(LayoutError, match="ep=3 must divide the 128 experts"):
        validate_layout(ParallelConfig.parse("dp6-tp1-pp1-ep3"), spec)
    with pytest.raises(LayoutError, match="needs experts"):
        validate_layout(ParallelConfig.parse("dp2-tp1-pp1-ep2"), preset("llama2-7b"))


def test_uneven_pipelines_say_where_each_layer_goes():
    """``-firstN``/``-lastN``: N layers on that end stage, the rest evenly over the stages between."""
    layout = ParallelConfig.parse("last3-pp4-dp2-first1")
    assert str(layout) == "dp2-tp1-pp4-first1-last3" and layout.uneven
    assert layout.stage_layers(10) == (1, 3, 3, 3) and layout.layer_cuts(10) == (0, 1, 4, 7, 10)
    assert ParallelConfig.parse("pp2-first3").stage_layers(8) == (3, 5)
    assert ParallelConfig.parse("pp3-last1").stage_layers(5) == (2, 2, 1)
    assert ParallelConfig.parse("pp2-first1-last1").stage_layers(2) == (1, 1)
    assert ParallelConfig.parse("pp4").stage_layers(8) == (2, 2, 2, 2) and not ParallelConfig.parse("pp4").uneven


@pytest.mark.parametrize("text, layers, fragment, hint", [
    ("pp4-first2-last2", 7, "leave 3 of the 7 layers to 2 middle stage(s)", "dp1-tp1-pp4-first1-last2"),
    ("pp2-first2-last1", 4, "leave 1 of the 4 layers to 0 middle stage(s)", "dp1-tp1-pp2-first2-last2"),
    ("pp2-first4", 4, "leave 0 of the 4 layers to 1 middle stage(s)", "dp1-tp1-pp2"),
    ("pp3", 7, "pp=3 must divide the 7 layers", "dp1-tp1-pp3-first1-last1"),
])
def test_splits_that_do_not_fit_are_refused_with_splits_that_do(text, layers, fragment, hint):
    layout = ParallelConfig.parse(text)
    assert fragment in layout.pipeline_problem(layers)
    with pytest.raises(LayoutError) as err:
        layout.stage_layers(layers)
    assert fragment in str(err.value) and hint in str(err.value).split("HINT")[1]


def test_an_uneven_layout_is_validated_against_the_model_and_its_nearest_keep_the_ends():
    spec = preset("llama2-70b")  # 80 layers
    assert validate_layout(ParallelConfig.parse("dp16-tp8-pp8-first7-last7"), spec)
    with pytest.raises(LayoutError) as err:
        validate_layout(ParallelConfig.parse("dp16-tp8-pp8-first8-last8"), spec)
    assert "leave 64 of the 80 layers to 6 middle stage(s)" in str(err.value)
    assert "dp32-tp8-pp4-first8-last8" in str(err.value)  # the same ends where another pp takes them
