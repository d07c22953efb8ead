"""A switch's deadline (``SwitchDeadline``), ``switch_timeout``'s parsing and the fault hook's (no processes).

The behaviour under a lost rank is in ``tests/megatron/test_switch_faults.py`` (hot switch, SIGKILL
and SIGSTOP) and ``tests/strategy/test_switch_fault_fit.py`` (a ``Trainer``).
"""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest

from lightning_dynatrain.transition import LinkCosts
from lightning_dynatrain.transition.deadline import (
    DEFAULT_FLOOR_S,
    FALLBACK_BYTES_PER_S,
    SwitchDeadline,
    moved_bytes,
    parse_switch_timeout,
)
from lightning_dynatrain.transition.program import Exchange
from lightning_dynatrain.transition.watch import FaultInjection
from lightning_dynatrain.vps.errors import DynaTrainError
from lightning_dynatrain.vps.gpt_spec import GPTDims
from tests.transition.cases import Case

WIDE = GPTDims(num_layers=2, hidden=24, num_heads=4, num_query_groups=2, head_dim=6, ffn_hidden=20, vocab_size=50,
               seq_length=8, make_vocab_size_divisible_by=8)


def test_derived_deadline_grows_with_the_bytes_and_the_link_speed():
    program = Case(WIDE, "dp2-zero1", "tp2").program(0, "dp2-zero1", "tp2")
    p2p, bcast = moved_bytes(program)
    assert bcast == 0 and p2p == sum(m.nbytes for s in program.steps if isinstance(s, Exchange)
                                     for m in s.sends + s.recvs) > 0
    assumed = SwitchDeadline.derive(program, None)
    assert assumed.seconds == pytest.approx(DEFAULT_FLOOR_S + 10 * p2p / FALLBACK_BYTES_PER_S)
    assert "assumed" in assumed.why and str(assumed).startswith(f"{assumed.seconds:.0f} s (60 s floor + 10 x")
    slow = LinkCosts(p2p_bytes_per_s=p2p / 3.0, broadcast_bytes_per_s=1e9)
    derived = SwitchDeadline.derive(program, slow, margin=4, floor_s=5)
    assert derived.seconds == pytest.approx(5 + 4 * 3.0) and "measured" in derived.why
    assert derived.timedelta == timedelta(seconds=derived.seconds)


def test_switch_timeout_is_parsed_once_with_a_clear_error():
    assert parse_switch_timeout(None) is None
    assert parse_switch_timeout(90) == SwitchDeadline(90.0, "switch_timeout")
    assert parse_switch_timeout(timedelta(minutes=2)).seconds == 120.0
    # the text of a config file or an environment variable (DYNATRAIN_SWITCH_TIMEOUT)
    assert parse_switch_timeout(" 90 ") == SwitchDeadline(90.0, "switch_timeout")
    assert parse_switch_timeout("auto") is None and parse_switch_timeout("") is None
    assert parse_switch_timeout(parse_switch_timeout(30)) == SwitchDeadline(30.0, "switch_timeout")
    for bad in (0, -1, "ninety", "0", True):
        with pytest.raises(DynaTrainError, match="switch_timeout|deadline"):
            parse_switch_timeout(bad)


def test_fault_hook_parses_rank_phase_signal_and_switch():
    assert FaultInjection.parse("2:transfer:KILL") == FaultInjection(2, "transfer", int(signal.SIGKILL), 1)
    assert FaultInjection.parse("0:confirm:stop").signal == int(signal.SIGSTOP)
    assert FaultInjection.parse("2:transfer:KILL:2").switch == 2
    for bad in ("2:transfer", "x:transfer:KILL", "1:moving:KILL", "1:transfer:HUP", "1:transfer:KILL:x"):
        with pytest.raises(DynaTrainError, match="RANK:PHASE:SIGNAL"):
            FaultInjection.parse(bad)
