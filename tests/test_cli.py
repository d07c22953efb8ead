"""The ``dynatrain plan`` command, run as a user runs it (a real subprocess)."""

import json
import subprocess
import sys

import pytest

KEYS = {"weights_only", "parameters", "state_bytes", "moved_bytes", "retained_bytes", "intra_node_bytes", "inter_node_bytes",
        "max_rank_send_bytes", "max_rank_recv_bytes", "plan_seconds", "plan_seconds_per_rank_max",
        "estimated_transfer_seconds"}


def dynatrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_dynatrain.cli", *args], capture_output=True, text=True,
                          timeout=300)


def plan_json(*args: str) -> dict:
    out = dynatrain("plan", *args, "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(figures) == KEYS
    return figures


def test_data_to_tensor_parallel_without_zero_moves_nothing():
    f = plan_json("--model", "llama2-7b", "--src", "dp4-tp1-pp1", "--dst", "dp2-tp2-pp1")
    assert f["moved_bytes"] == 0
    assert f["retained_bytes"] > 0


def test_tp4_to_dp4_moves_three_full_copies():
    f = plan_json("--model", "llama2-7b", "--src", "dp1-tp4-pp1", "--dst", "dp4-tp1-pp1", "--precision", "fp32")
    # each of the 4 destination ranks needs the 3/4 of the state it did not hold
    assert f["moved_bytes"] == pytest.approx(3 * f["state_bytes"], rel=0.01)
    assert f["moved_bytes"] == f["intra_node_bytes"] + f["inter_node_bytes"]
    assert f["state_bytes"] == f["parameters"] * 12


def test_weights_only_moves_the_bf16_params_alone():
    """tp4 -> dp4 at bf16: each of the 4 destination ranks needs the 3/4 of the params it did not
    hold, 2 bytes an element (the full switch moves 3/4 of 2 + 4 + 4 + 4 bytes an element: 7x as much)."""
    args = ("--model", "llama2-7b", "--src", "dp1-tp4-pp1-zero1", "--dst", "dp4-tp1-pp1", "--precision", "bf16")
    weights, full = plan_json(*args, "--weights-only"), plan_json(*args)
    assert weights["weights_only"] is True and full["weights_only"] is False
    assert weights["state_bytes"] == pytest.approx(weights["parameters"] * 2, rel=1e-3)  # (its norms are fp32)
    assert weights["moved_bytes"] == pytest.approx(3 * weights["state_bytes"], rel=0.01)
    assert full["moved_bytes"] == pytest.approx(7 * weights["moved_bytes"], rel=0.01)


def test_1024_rank_plan_from_virtual_stages_to_an_uneven_pipeline_moves_the_layers_that_change_rank():
    """llama2-70b's 80 layers at pp8-vpp5 (megatron's interleaving: 2-layer chunks dealt round-robin over
    the 8 pipeline ranks) -> pp8 with 7 layers on each end stage and 11 on each of the 6 between. Every
    layer whose pipeline rank changes moves its fp32 state (param and Adam's two moments, 12 bytes a
    parameter) to each of the 16 data-parallel replicas: its 855,654,400 parameters, and its two norms'
    16,384 (replicated over tp) to the 7 other tp ranks as well; nothing else moves."""
    interleaved = [(layer // 2) % 8 for layer in range(80)]
    uneven = [0] * 7 + [stage for stage in range(1, 7) for _ in range(11)] + [7] * 7
    moved_layers = sum(a != b for a, b in zip(interleaved, uneven))
    f = plan_json("--model", "llama2-70b", "--src", "dp16-tp8-pp8-vpp5", "--dst", "dp16-tp8-pp8-first7-last7",
                  "--precision", "fp32")
    assert moved_layers == 68
    assert f["moved_bytes"] == moved_layers * (855_654_400 + 7 * 16_384) * 12 * 16
    assert f["max_rank_recv_bytes"] <= f["moved_bytes"] and f["estimated_transfer_seconds"] > 0


def test_single_rank_report_prints_its_plan():
    out = dynatrain("plan", "--model", "llama2-7b", "--src", "dp2-tp2-pp1", "--dst", "dp1-tp2-pp2", "--rank", "3",
                    "--gpus-per-node", "2")
    assert out.returncode == 0, out.stderr
    assert "rank 3 dp2-tp2-pp1->dp1-tp2-pp2:" in out.stdout
    assert "moved_bytes" in out.stdout


@pytest.mark.parametrize("args, message", [
    (("--model", "gpt-5", "--src", "dp2-tp1-pp1", "--dst", "dp1-tp2-pp1"), "unknown model 'gpt-5'"),
    (("--model", "llama2-7b", "--src", "dp2-tx1", "--dst", "dp1-tp2-pp1"), "unknown part 'tx1'"),
    (("--model", "llama2-7b", "--src", "dp1-tp3-pp1", "--dst", "dp1-tp2-pp1"), "tp=3 must divide the 32 attention heads"),
    (("--model", "llama2-7b", "--src", "dp2-tp1-pp1", "--dst", "dp1-tp2-pp1", "--rank", "9"), "outside the union world"),
])
def test_bad_input_exits_2_with_the_reason_and_no_traceback(args, message):
    out = dynatrain("plan", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_plot_writes_a_heatmap_and_keeps_json_on_stdout(tmp_path):
    picture = tmp_path / "switch.png"
    out = dynatrain("plan", "--model", "llama2-7b", "--src", "dp2-tp2-pp4", "--dst", "dp4-tp4-pp1",
                    "--gpus-per-node", "4", "--plot", str(picture), "--json")
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout.strip().splitlines()[-1])) == KEYS  # stdout: the JSON object alone
    assert f"wrote {picture}" in out.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000


def test_plot_needs_a_picture_suffix(tmp_path):
    out = dynatrain("plan", "--model", "llama2-7b", "--src", "dp2-tp1-pp1", "--dst", "dp1-tp2-pp1",
                    "--plot", str(tmp_path / "switch.txt"))
    assert out.returncode == 2
    assert "cannot tell the picture's format" in out.stderr and "HINT" in out.stderr


def test_a_plan_longer_than_the_threshold_prints_a_progress_line(monkeypatch, capsys, tmp_path):
    """In process, with the threshold at 0 s: the line names the ranks and ends with the time taken."""
    from lightning_dynatrain import cli

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    assert cli.main(["plan", "--model", "llama2-7b", "--src", "dp8-tp4-pp2", "--dst", "dp4-tp8-pp2",
                     "--plot", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err
    assert "dynatrain plan: planning 64 ranks of llama2-7b" in err
    assert "dynatrain plan: bytes between 64 ranks" in err
    assert "done in" in err
