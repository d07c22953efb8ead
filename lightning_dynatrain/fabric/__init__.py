"""Lightning Fabric: a loop written with Fabric trains a megatron-core GPT under the project's layouts
and switches layout between steps, launched with ``fabric run``, ``torchrun``, ``srun`` or
``python train.py`` (``Fabric(devices=N).launch()`` starts the other processes).

What a user writes (every rank runs it; ``fabric run --accelerator cpu --devices 4 train.py``)::

    from lightning.fabric import Fabric
    from lightning_dynatrain.fabric import DynaTrainEngine, DynaTrainFabricStrategy
    from lightning_dynatrain.data import StdlibBytes
    from lightning_dynatrain.megatron.gpt import GPTShape
    from lightning_dynatrain.runtime.recipe import AdamSettings, MegatronRecipe, warmup_cosine_lr

    strategy = DynaTrainFabricStrategy(layout="dp2-tp2-pp1", schedule={100: "dp1-tp2-pp2"})
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)   # precision="bf16-true": bf16 params
    fabric.launch()                  # not under `fabric run`: there Fabric() launches itself
    fabric.seed_everything(1234)
    shape = GPTShape(hidden=128, layers=4, heads=4, ffn_hidden=512, vocab_size=256, seq_length=128,
                     make_vocab_size_divisible_by=64)
    engine = DynaTrainEngine(fabric,
                             recipe=MegatronRecipe(model=shape, seed=1234, global_batch_size=16, micro_batch_size=2),
                             adam=AdamSettings(lr=3e-3, weight_decay=0.01),
                             lr_at=lambda step: warmup_cosine_lr(step, peak=3e-3, warmup_steps=30, max_steps=300))
    model, optimizer = fabric.setup(engine.model, engine.optimizer)
    loader = fabric.setup_dataloaders(engine.dataloader(StdlibBytes(128), shuffle=True, seed=1234))

    for step, batch in zip(range(300), loader):
        loss = model(batch)          # the whole megatron step: pipeline schedule, grads, optimizer step
        fabric.backward(loss)        # nothing left to do
        optimizer.step()             # the step boundary: step 100's switch to dp1-tp2-pp2 runs here
        optimizer.zero_grad()
        fabric.print(f"step {step + 1} loss {loss.item():.4f} at {engine.layout}")
    fabric.save("checkpoint", {"model": model, "optimizer": optimizer, "engine": engine})
    engine.close()

Validation: ``model.eval()`` makes ``model(batch)`` the forward-only loss of a global batch at the
current layout (``engine.eval_step``), over ``fabric.setup_dataloaders(engine.eval_dataloader(dataset))``.
``fabric.save`` writes the engine's layout-free checkpoint and Fabric's own file of the rest;
``fabric.load`` of it resumes at any layout and number of processes. ``DynaTrainEngine`` is the one the
Accelerate integration uses (``lightning_dynatrain.loop``): the same step, switches and messages.

Elastic: ``DynaTrainFabricStrategy(layout=..., elastic=ElasticOptions({2: "dp2-tp1-pp1", 3: "dp3-tp1-pp1"}))``
under ``torchrun``/``srun`` with ``DYNATRAIN_STORE`` and ``DYNATRAIN_TOKEN`` set: processes join and
leave the running loop and a member lost without leaving is recovered from, as under ``OnNodeChange``
(whose options ``ElasticOptions`` holds). The loop ends where ``engine.should_stop`` says (this
process left); ``fabric.world_size`` and ``fabric.global_rank`` follow the job's world.

The pieces: ``strategy`` (``DynaTrainFabricStrategy``: no DDP wrapper, no distributed sampler,
megatron's own precision, the engine's checkpoints, threads fitted to the cores) ``library`` (a
launched Fabric as the engine's ``LoopLibrary``) and ``engine`` (``DynaTrainEngine`` over a Fabric).
"""

from lightning_dynatrain.elastic.driver.options import ElasticOptions
from lightning_dynatrain.fabric.engine import DynaTrainEngine
from lightning_dynatrain.fabric.strategy import DynaTrainFabricStrategy, FabricSetupError
from lightning_dynatrain.loop.engine import DataMismatchError
from lightning_dynatrain.runtime.settings import DynaTrainSettings

__all__ = ["DataMismatchError", "DynaTrainEngine", "DynaTrainFabricStrategy", "DynaTrainSettings", "ElasticOptions",
           "FabricSetupError"]
