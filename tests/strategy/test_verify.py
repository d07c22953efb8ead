"""``verify=True`` catches a single flipped bit after a switch, in every dtype and state kind (2 processes).

A bf16 model (bf16 params, fp32 norms, fp32 main params, Adam moments) switches ``dp2 -> dp1-pp2``
(every tensor kept in place: the new model's tensors are the old ones) and ``dp1-pp2 -> dp1-tp2``
(copied and exchanged). After each, one bit of one destination tensor is flipped (after the engine
wrote it, outside the fingerprint's path) and the strategy's check (``switching.verify_unchanged``)
must raise ``SwitchVerificationError`` on every rank, naming the tensor; with the bit flipped back,
it passes.
"""

from __future__ import annotations

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.slow

SHAPE = dict(hidden=32, layers=2, heads=4, ffn_hidden=64, vocab_size=256, seq_length=16,
             make_vocab_size_divisible_by=128)
CHAIN = ["dp2-tp1-pp1", "dp1-tp1-pp2", "dp1-tp2-pp1"]


def _flip(tensor) -> None:
    """Flip the lowest bit of the first element, through an integer view (the same bytes)."""
    import torch

    bits = tensor.view(-1).view({2: torch.int16, 4: torch.int32}[tensor.element_size()])
    bits[0] ^= 1


def _job(rank: int, world_size: int) -> list[dict]:
    import torch

    from lightning_dynatrain.megatron.gpt import GPTShape, build_gpt_model
    from lightning_dynatrain.megatron.hot_switch import SwitchSetup, hot_switch
    from lightning_dynatrain.megatron.optimizer import build_ddp_and_optimizer
    from lightning_dynatrain.megatron.train_step import run_train_step
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy, initialize_for_layout
    from lightning_dynatrain.megatron.state import MegatronState
    from lightning_dynatrain.megatron.state_bridge import megatron_store
    from lightning_dynatrain.runtime.switcher import SwitchVerificationError, fingerprint, verify_unchanged
    from lightning_dynatrain.vps.layout import ParallelConfig

    shape = GPTShape(**SHAPE)
    setup = SwitchSetup(model=shape, seed=7, optimizer=dict(lr=1e-3), staging_budget=2**20)
    first = ParallelConfig.parse(CHAIN[0])
    groups = initialize_for_layout(first, seed=7)
    ddp, optimizer = build_ddp_and_optimizer(build_gpt_model(shape, first, seed=7, params_dtype=torch.bfloat16), first,
                                             lr=1e-3)
    state = MegatronState(layout=first, groups=groups, chunks=(ddp,), optimizer=optimizer)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))[rank:rank + 1]
    run_train_step(ddp, optimizer, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}, first, 1)
    out = []
    for text in CHAIN[1:]:
        before = fingerprint(state, setup)
        old = {key: t.data_ptr() for key, t in megatron_store(state.ddp, state.optimizer, setup.spec,
                                                                state.layout, rank).items()}
        state = hot_switch(state, ParallelConfig.parse(text), setup).state
        store = megatron_store(state.ddp, state.optimizer, setup.spec, state.layout, rank)
        # one tensor per (dtype, state kind), and whether the switch kept it in place
        picked = {}
        for key, tensor in store.items():
            picked.setdefault((str(tensor.dtype), key[1].value, old.get(key) == tensor.data_ptr()), key)
        caught = {}
        for pick in sorted(picked):
            key = picked[pick]  # rank 0's tensor: rank 0 flips a bit of it, every rank checks
            if rank == 0:
                _flip(store[key])
            try:
                verify_unchanged(before, state, setup)
                caught[str(pick)] = (key[0], None)
            except SwitchVerificationError as err:
                caught[str(pick)] = (key[0], str(err))
            if rank == 0:
                _flip(store[key])  # back
            verify_unchanged(before, state, setup)  # the original again: no difference
        out.append(dict(layout=text, picked={k: (key[0], key[1].value) for k, key in picked.items()},
                        caught=caught))
    destroy()
    return out


def test_a_flipped_bit_in_any_dtype_and_state_kind_is_caught_on_every_rank():
    runs = run_distributed(_job, 2, timeout_s=240)
    kinds_seen, kept_seen = set(), set()
    for switch in zip(*runs):  # one switch, both ranks
        picked = switch[0]["picked"]
        assert len(picked) >= 4, picked
        for (dtype, kind, kept), (tensor, _) in picked.items():
            kinds_seen.add((dtype, kind))
            kept_seen.add(kept)
        for rank_result in switch:  # rank 0 flipped, every rank raised the same error, naming the tensor
            assert rank_result["caught"].keys() == switch[0]["caught"].keys()
            for pick, (tensor, error) in switch[0]["caught"].items():
                assert error is not None, f"{pick} {tensor}: a flipped bit went unnoticed"
                assert tensor in error and "HINT" in error
                assert rank_result["caught"][pick][1] == error
    assert {("torch.bfloat16", "param"), ("torch.float32", "param"), ("torch.float32", "main_param"),
            ("torch.float32", "exp_avg"), ("torch.float32", "exp_avg_sq")} <= kinds_seen
    assert kept_seen == {True, False}, "both a tensor kept in place and a copied one were corrupted"
