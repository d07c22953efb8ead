"""What one GPU can prove about lightning-dynatrain, in one process (world 1), in a few minutes.

``scripts/gpu_check.sh`` runs it (and installs carried wheels first where the machine lacks a
package). Each check prints ``PASS``, ``FAIL`` or ``SKIP`` with its figures or its reason; the
summary says what was proved and what stays unchecked. On a machine without CUDA the device parts
are skipped with that reason and the rest runs on the CPU, so the script is tested where CI runs.

Checks, in order:

1. the default group is made on the device (NCCL with ``device_id``, gloo on CPU);
2. the model is built on the device in bf16 (megatron's mixed precision: bf16 params, fp32 main
   params) and a training step gives a finite loss;
3. a world-1 switch turns zero1 on and then off again, the full logical state fingerprinted on both
   sides of each (``verify=True``): params, fp32 main params, both Adam moments, bit for bit;
4. the switch's memory bound (``HotSwitchResult.need_bytes``, what the memory check compares with
   the free memory) against the device memory the switch really took
   (``torch.cuda.max_memory_allocated`` over the switch, above what was allocated before it);
5. the shard a switch builds lives on the device (no host copy);
6. the engine's own GPU test (``tests/transition/test_switch_gpu.py``, world 1), where pytest is installed;
7. a model of the user's built from Transformer Engine's layer spec
   (``get_gpt_layer_with_transformer_engine_spec``) through ``ModelProvider``, unchanged: its spec
   read from megatron's description, two bf16 steps, zero1 on and off bit for bit (skipped without
   a device or without Transformer Engine, saying which);
8. an in-memory snapshot's copy into host memory beside training (``devices.snapshot_copy``: on CUDA a
   side stream after the training stream's event, into pinned buffers): the copy sees an update
   enqueued before the boundary and overlaps work enqueued after it.

Unchecked with one GPU: NCCL across ranks (NCCL puts no two ranks on one device), tensor and
pipeline parallel layouts, world changes.

Usage: ``python scripts/gpu_check.py [--json]``; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
UNCHECKED = ["NCCL across ranks (one GPU: NCCL puts no two ranks on one device)",
             "tensor- and pipeline-parallel layouts on the device", "world changes (the EDM) on the device"]


class Checks:
    """Runs named checks, each ``PASS``/``FAIL``/``SKIP`` with a line of figures or a reason."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def run(self, name: str, check: Callable[[], str], *, skip: str | None = None) -> None:
        if skip is not None:
            self._row(name, "SKIP", skip, 0.0)
            return
        start = time.perf_counter()
        try:
            self._row(name, "PASS", check(), time.perf_counter() - start)
        except Exception as err:  # noqa: BLE001 - every failure is reported, then the next check runs
            self._row(name, "FAIL", f"{type(err).__name__}: {err}"[:500], time.perf_counter() - start)

    def _row(self, name: str, verdict: str, detail: str, seconds: float) -> None:
        self.rows.append(dict(check=name, verdict=verdict, detail=detail, seconds=round(seconds, 2)))
        print(f"[gpu_check] {verdict:4} {name} ({seconds:.1f} s): {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(r["verdict"] == "FAIL" for r in self.rows)


def _init_world(device: torch.device) -> str:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(minutes=2),
                            device_id=device if device.type == "cuda" else None)
    return f"{backend} world 1" + (f" bound to {device}" if device.type == "cuda" else "")


class Run:
    """The world-1 training state the checks share: bf16 GPT, megatron DDP and optimizer."""

    def __init__(self, device: torch.device, model=None) -> None:
        from lightning_dynatrain.megatron.shapes import model_shape
        from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe
        from lightning_dynatrain.runtime.switcher import LayoutSwitcher
        from lightning_dynatrain.vps.layout import ParallelConfig
        from lightning_dynatrain.vps.topology import Topology

        self.device = device
        if model is None:
            model = model_shape("llama", hidden=256, layers=4, heads=8, ffn_hidden=1024, vocab_size=256, seq_length=128)
        self.recipe = MegatronRecipe(model=model, seed=1234, global_batch_size=8, micro_batch_size=2,
                                     params_dtype=torch.bfloat16)
        self.adam = AdamSettings(lr=1e-3, weight_decay=0.01)
        self.layout = ParallelConfig.parse("dp1-tp1-pp1")
        self.switcher = LayoutSwitcher(staging_budget=64 * 2**20, verify=True)
        self.switcher.new_world(Topology.uniform(1, 1))
        self.state = None
        self.results: list = []

    def build(self) -> str:
        from lightning_dynatrain.runtime.training_state import attach_optimizer, build_model, init_groups

        groups = init_groups(self.layout, seed=self.recipe.seed, groups=self.switcher.groups)
        model = build_model(self.recipe, self.layout, groups, device=self.device)
        self.state = attach_optimizer(model, self.recipe, self.layout, self.adam, groups)
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        devices = sorted({str(p.device) for p in model.parameters()})
        params = sum(p.numel() for p in model.parameters())
        if devices != [str(self._device_name())]:
            raise AssertionError(f"parameters on {devices}, not on {self.device}")
        return f"{params / 1e6:.1f}M params, dtypes {dtypes}, on {devices}"

    def _device_name(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else self.device

    def step(self) -> str:
        from lightning_dynatrain.runtime.steps import train_step

        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (self.recipe.global_batch_size, self.recipe.model.seq_length + 1),
                               generator=generator)
        batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
        losses = [train_step(self.state, batch, self.recipe, lr=self.adam.lr, weight_decay=self.adam.weight_decay)
                  for _ in range(2)]
        if not all(torch.isfinite(torch.tensor(losses))):
            raise AssertionError(f"losses {losses}")
        return f"losses {losses[0]:.4f}, {losses[1]:.4f} (bf16 params, fp32 main params)"

    def switch(self, target: str) -> str:
        from lightning_dynatrain.megatron.hot_switch import hot_switch
        from lightning_dynatrain.runtime.switcher import fingerprint, verify_unchanged
        from lightning_dynatrain.vps.layout import ParallelConfig

        setup = self.switcher.setup(self.recipe, self.adam)
        before_fp = fingerprint(self.state, setup)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated() if cuda else 0
        result = hot_switch(self.state, ParallelConfig.parse(target), setup, groups=self.switcher.groups,
                            subgroups=self.switcher.subgroups)
        peak = torch.cuda.max_memory_allocated() - allocated if cuda else None
        verify_unchanged(before_fp, result.state, setup)  # raises naming the tensor that differs
        self.state = result.state
        self.results.append(dict(target=target, need=result.need_bytes, peak=peak, seconds=result.seconds))
        return (f"{result.report.retained_bytes / 2**20:.1f} MiB kept on the device, {result.seconds:.2f} s, "
                f"logical state bit for bit")

    def memory_bound(self) -> str:
        rows = []
        for r in self.results:
            if r["need"] is None:
                raise AssertionError(f"the switch to {r['target']} was not memory-checked")
            if r["peak"] > r["need"]:
                raise AssertionError(f"switch to {r['target']}: took {r['peak']} bytes on the device above what "
                                     f"was allocated, over its bound of {r['need']}")
            rows.append(f"{r['target']}: took {r['peak'] / 2**20:.1f} MiB <= bound {r['need'] / 2**20:.1f} MiB")
        return "; ".join(rows)

    def built_on_device(self) -> str:
        from lightning_dynatrain.megatron.gpt import build_gpt_model
        from lightning_dynatrain.megatron.parallel_state_adapter import current_process_groups

        host_before = _host_rss()
        model = build_gpt_model(self.recipe.model, self.layout, seed=self.recipe.seed,
                                params_dtype=self.recipe.params_dtype, initialize=False,
                                pg_collection=current_process_groups(), device=self.device)
        devices = sorted({p.device.type for p in model.parameters()})
        if devices != ["cuda"]:
            raise AssertionError(f"a switch's shard was allocated on {devices}")
        grown = _host_rss() - host_before
        del model
        return f"allocated on the device; host memory grew {grown / 2**20:.1f} MiB meanwhile"


def _te_provider():
    """A GPT of the user's on Transformer Engine's layer spec, as ``examples/own_model.py --te`` builds it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer import TransformerConfig

    from lightning_dynatrain import ModelProvider, padded_vocab_size
    from lightning_dynatrain.megatron.gpt import gpt_forward_step

    def provider(config, pg_collection, pre_process, post_process):
        return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                        vocab_size=padded_vocab_size(256, config), max_sequence_length=128, pre_process=pre_process,
                        post_process=post_process, pg_collection=pg_collection)

    config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                               hidden_dropout=0.0, attention_dropout=0.0)
    return ModelProvider(config=config, model_provider=provider, forward_step=gpt_forward_step,
                         vocab_size=256, seq_length=128, name="te-gpt")


def _te_case(device: torch.device) -> str:
    from lightning_dynatrain.megatron.parallel_state_adapter import destroy

    destroy()
    run = Run(device, _te_provider())
    built = run.build()
    tensors = len(run.recipe.model.spec().tensors)
    steps = run.step()
    run.switch("dp1-tp1-pp1-zero1")
    run.switch("dp1-tp1-pp1")
    return f"{built}; {tensors} tensors read from its description; {steps}; zero1 on and off bit for bit"


def _snapshot_copy(device: torch.device) -> str:
    import threading

    from lightning_dynatrain.devices import device_kind

    copier = device_kind(device).host_copier()
    state = torch.arange(1 << 24, dtype=torch.float32, device=device)
    buffer = copier.host_buffer(state)
    state.mul_(3)  # the optimizer step, enqueued before the boundary: the copy must see it
    copier.mark()
    start = time.perf_counter()
    thread = threading.Thread(target=copier.copy, args=([(buffer, state)],))
    thread.start()
    beside = (state * 2).sum()  # the next step's work on the training stream, beside the copy
    thread.join()
    seconds = time.perf_counter() - start
    expected = torch.arange(1 << 24, dtype=torch.float32) * 3
    if not torch.equal(buffer, expected) or not torch.isfinite(beside.cpu()):
        raise AssertionError("the host copy does not hold the state as the boundary left it")
    pinned = device.type == "cuda" and buffer.is_pinned()
    return f"{type(copier).__name__}: {state.nbytes / 2**20:.0f} MiB in {seconds:.3f} s, pinned buffer: {pinned}"


def _host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _engine_gpu_test() -> str:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "tests/transition/test_switch_gpu.py::test_world1_local_copies_on_gpu"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(command[2:])}: {tail}")
    return tail[0] if tail else "passed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    no_device = None if cuda else "no CUDA device on this machine"
    if cuda:
        torch.cuda.set_device(device)
    print(f"[gpu_check] torch {torch.__version__}, " +
          (f"{torch.cuda.get_device_name(device)}" if cuda else "CPU only: the device checks are skipped"),
          flush=True)
    checks = Checks()
    checks.run("default group", lambda: _init_world(device))
    run = Run(device)
    checks.run("bf16 model built on the device" if cuda else "bf16 model built (CPU)", run.build)
    built = not checks.failed
    blocked = None if built else "the model was not built"
    checks.run("bf16 training steps", run.step, skip=blocked)
    checks.run("switch dp1 -> dp1-zero1", lambda: run.switch("dp1-tp1-pp1-zero1"), skip=blocked)
    checks.run("switch dp1-zero1 -> dp1", lambda: run.switch("dp1-tp1-pp1"), skip=blocked)
    checks.run("memory bound vs torch.cuda.max_memory_allocated", run.memory_bound,
               skip=no_device or (None if len(run.results) == 2 else "the switches did not run"))
    checks.run("a switch's shard allocated on the device", run.built_on_device, skip=no_device or blocked)
    import importlib.util

    checks.run("engine GPU test (world 1)", _engine_gpu_test,
               skip=no_device or (None if importlib.util.find_spec("pytest") else "pytest is not installed"))
    no_te = None if importlib.util.find_spec("transformer_engine") else \
        "Transformer Engine is not installed (pip install --no-build-isolation transformer_engine[pytorch])"
    checks.run("own model on Transformer Engine's layer spec", lambda: _te_case(device), skip=no_device or no_te)
    checks.run("snapshot copy into host memory beside training", lambda: _snapshot_copy(device))
    dist.destroy_process_group()
    proved = [r["check"] for r in checks.rows if r["verdict"] == "PASS"]
    print(f"[gpu_check] proved: {', '.join(proved) or 'nothing'}")
    print(f"[gpu_check] unchecked here: {'; '.join(UNCHECKED)}")
    if args.json:
        print(json.dumps(dict(cuda=cuda, device=torch.cuda.get_device_name(device) if cuda else "cpu",
                              torch=torch.__version__, checks=checks.rows, unchecked=UNCHECKED,
                              failed=checks.failed)))
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
