"""What a failed switch or phase says about the state it leaves: refused (whole), or freed in part."""

from __future__ import annotations

from lightning_dynatrain.transition.errors import SwitchFailedError, freed_state, mark_freed, mark_refused, was_refused


def _failed(*, lost_state: bool, freed: bool | None = None) -> SwitchFailedError:
    return SwitchFailedError("rank 3 went missing", hint="-", rank=3, phase="transfer", lost_state=lost_state,
                             resume_from=None, freed=freed)


def test_a_state_is_freed_when_a_switch_freed_it_or_the_failure_was_marked() -> None:
    assert not freed_state(None) and not freed_state(RuntimeError("Connection closed by peer"))
    assert freed_state(_failed(lost_state=True))  # ``freed`` defaults to ``lost_state``
    assert not freed_state(_failed(lost_state=True, freed=False))  # only the dead's parts are gone
    err = RuntimeError("Connection closed by peer")  # a rollout's refill that failed: any error type
    assert mark_freed(err) is err and freed_state(err)
    assert not was_refused(err) and was_refused(mark_refused(ValueError("bad layout")))
