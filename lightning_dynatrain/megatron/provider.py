"""A user's megatron-core model, layout-free, in megatron's own terms.

Megatron-LM's ``pretrain`` takes a model as a ``TransformerConfig``, a ``model_provider`` and a
``forward_step``; ``ModelProvider`` takes the same three, with no parallel sizes in the config: the
strategy sets tensor, pipeline, expert and expert-tensor parallelism (and sequence parallelism and
recompute) per layout, and calls the provider again at every layout it switches to.

What a switch moves is read from the model itself: megatron's ``sharded_state_dict()`` at a few
storage-free probe layouts (``megatron.probe``) gives the Virtual Parameter Space
(``vps.derive``), so any module that describes its shards switches with no hand-written spec. A
parameter nothing describes, or floating state outside parameters, is refused when the spec is
read (before training starts), naming it.

Example::

    def model_provider(config, pg_collection, pre_process, post_process):
        return GPTModel(config=config, transformer_layer_spec=my_layer_spec(config),
                        vocab_size=padded_vocab_size(50257, config), max_sequence_length=2048,
                        pre_process=pre_process, post_process=post_process, pg_collection=pg_collection)

    provider = ModelProvider(config=TransformerConfig(num_layers=24, hidden_size=1024, num_attention_heads=16),
                             model_provider=model_provider, forward_step=forward_step,
                             vocab_size=50257, seq_length=2048)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from lightning_dynatrain.devices import device_kind
from lightning_dynatrain.megatron.execution import ExecutionOptions, check_trainable
from lightning_dynatrain.megatron.model_chunks import ChunkStage, build_chunks, pipeline_config_kwargs
from lightning_dynatrain.megatron.tp_attributes import tag_tensor_parallel_weights
from lightning_dynatrain.vps.description import DerivedSpec
from lightning_dynatrain.vps.errors import LayoutError, ModelSpecError
from lightning_dynatrain.vps.layout import ParallelConfig
from lightning_dynatrain.vps.shards import VocabPadding
from lightning_dynatrain.vps.spec import ModelSpec
from lightning_dynatrain.vps.validate import validate_layout

#: the config fields a layout sets (a layout-free config leaves them at megatron's defaults)
_PARALLEL_FIELDS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                    "context_parallel_size": 1, "expert_model_parallel_size": 1,
                    "expert_tensor_parallel_size": None, "sequence_parallel": False}
#: config fields that split the layers over pipeline stages (the layout's ``-firstN``/``-lastN``/``-vppN`` do here)
_PIPELINE_SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                          "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
                          "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def padded_vocab_size(vocab_size: int, config: TransformerConfig, divisible_by: int = 128) -> int:
    """Megatron-LM's vocabulary padding at ``config``'s tensor-parallel size: the next multiple of
    ``divisible_by * tp`` (``--make-vocab-size-divisible-by``). A model provider passes it as the
    vocabulary size of its embedding and output layer, and ``ModelProvider`` declares the same rule.

    >>> padded_vocab_size(50257, TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1))
    50304
    """
    return VocabPadding(vocab_size, divisible_by).padded(config.tensor_model_parallel_size)


def _stable(value: Any) -> str:
    """``repr`` without memory addresses (functions, closures): the same in every process."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelProvider:
    """A layout-free megatron-core model (see the module docstring)."""

    config: TransformerConfig
    """The model's ``TransformerConfig`` (or a subclass: ``MLATransformerConfig``, MoE options...)
    without parallel sizes: tp, pp, cp, ep, etp and sequence parallelism are the layout's."""
    model_provider: Callable[..., torch.nn.Module]
    """``model_provider(config, pg_collection, pre_process, post_process)`` -> this rank's megatron
    module (called with keywords; ``config`` carries the layout's parallel sizes and precision)."""
    forward_step: Callable[[Iterator[Any], torch.nn.Module], tuple[Any, Callable]]
    """``forward_step(data_iterator, model)`` -> ``(output, loss_func)`` as megatron's pipeline
    schedules call it; the iterator yields this data-parallel rank's micro-batches (dicts of the
    batch's tensors, cut along dim 0). ``loss_func(output)`` returns ``(loss, num_tokens,
    {"name": tensor([sum, count])})`` (per-token) or ``(loss, {"name": value})``."""
    vocab_size: int | None = None
    """The real vocabulary, when the model has one: its embedding and output layer are padded per
    tp by ``padded_vocab_size(vocab_size, config, make_vocab_size_divisible_by)``."""
    make_vocab_size_divisible_by: int = 128
    seq_length: int | None = None
    """Tokens per sequence (pipeline buffers, sequence-parallel checks); ``None``: the batch's
    ``tokens`` say it."""
    name: str = "model"
    _derived: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, TransformerConfig):
            raise ModelSpecError(f"ModelProvider.config is a {type(self.config).__name__}",
                                 hint="pass megatron's TransformerConfig (or a subclass of it)")
        for name in ("model_provider", "forward_step"):
            if not callable(getattr(self, name)):
                raise ModelSpecError(f"ModelProvider.{name} is not callable",
                                     hint=f"pass a function; see the {name} docstring")
        set_here = [f"{k}={getattr(self.config, k)}" for k, default in _PARALLEL_FIELDS.items()
                    if getattr(self.config, k, default) not in (default, None, 1, False)]
        if set_here:
            raise ModelSpecError(f"the model's TransformerConfig sets {', '.join(set_here)}",
                                 hint="leave parallel sizes out of the config: the strategy's layout sets them "
                                      "at every layout it runs (sequence parallelism, wherever tp > 1: "
                                      "MegatronLightningModule(sequence_parallel=True))")
        split_here = [f"{k}={getattr(self.config, k)}" for k in _PIPELINE_SPLIT_FIELDS
                      if getattr(self.config, k, None) not in (None, False)]
        if split_here:
            raise ModelSpecError(f"the model's TransformerConfig sets {', '.join(split_here)}",
                                 hint="leave the pipeline split out of the config: the layout states it, evenly, "
                                      "with the end stages' layers or virtual stages, e.g. 'dp1-tp1-pp4-first1-last1' "
                                      "or 'dp1-tp1-pp4-vpp2'")

    # ------------------------------------------------------------------------------ sizes
    @property
    def is_moe(self) -> bool:
        return bool(self.config.num_moe_experts)

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def layers(self) -> int:
        return self.config.num_layers

    @property
    def vocab(self) -> VocabPadding | None:
        return VocabPadding(self.vocab_size, self.make_vocab_size_divisible_by) if self.vocab_size else None

    def config_record(self) -> dict[str, str]:
        """The config's fields and the functions by name, as text the same in every process."""
        record = {f"config.{f.name}": _stable(getattr(self.config, f.name, None))
                  for f in dataclasses.fields(self.config)}
        return {"config": type(self.config).__name__, **record, "model_provider": _stable(self.model_provider),
                "forward_step": _stable(self.forward_step), "vocab": str(self.vocab), "seq_length": str(self.seq_length)}

    def __repr__(self) -> str:
        """Stable across processes (the elastic job's fingerprint): ``config_record``."""
        return f"ModelProvider(name={self.name!r}, {', '.join(f'{k}={v}' for k, v in self.config_record().items())})"

    # ------------------------------------------------------------------------------ layouts
    def config_at(self, layout: ParallelConfig, *, params_dtype: torch.dtype, execution: ExecutionOptions,
                  initialize: bool = True, on_device: bool = False) -> TransformerConfig:
        """The config at ``layout``: its parallel sizes and pipeline split (the layout's ``first``/``last``
        layers, in place of the config's own), sequence parallelism and recompute, precision
        (megatron's bf16 with fp32 main params, or fp32), CPU initialisation unless ``on_device``.

        Raises:
            LayoutError: megatron's own config checks refuse ``layout`` (e.g. tp not dividing the heads).
        """
        changes: dict[str, Any] = dict(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            num_layers_in_first_pipeline_stage=layout.first, num_layers_in_last_pipeline_stage=layout.last,
            **pipeline_config_kwargs(layout), context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
            **execution.config_kwargs(layout.tp, is_moe=self.is_moe),
            params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
            fp16=False, use_cpu_initialization=not on_device, perform_initialization=initialize)
        if self.is_moe:
            changes["expert_tensor_parallel_size"] = layout.etp
        try:
            return dataclasses.replace(self.config, **changes)
        except (AssertionError, ValueError) as err:
            raise LayoutError(f"layout {layout} does not fit {self.name}: megatron's TransformerConfig refuses it "
                              f"({err})", hint="pick a layout whose sizes divide the model's") from None

    def validate(self, layout: ParallelConfig, execution: ExecutionOptions) -> None:
        """Megatron's config checks at ``layout``, the derived spec's split rules, and the options'."""
        layout.stage_layers(self.config.num_layers)  # the pipeline split first: its error names splits that fit
        check_trainable(layout)
        if self.seq_length is not None:
            execution.check(str(layout), tp=layout.tp, seq_length=self.seq_length, is_moe=self.is_moe)
        self.config_at(layout, params_dtype=self.config.params_dtype, execution=execution)
        validate_layout(layout, self.spec())

    # ------------------------------------------------------------------------------ building
    def build(self, layout: ParallelConfig, *, seed: int, params_dtype: torch.dtype,
              pg_collection: ProcessGroupCollection, execution: ExecutionOptions, initialize: bool = True,
              device: torch.device | None = None, reseed: bool = True) -> torch.nn.Module:
        """This rank's module at ``layout``: the model provider's, on ``pg_collection``. Weights are
        the provider's own initialisation from torch's generator seeded with ``seed`` (megatron's CPU
        initialisation: every tp rank draws the same full weight and keeps its part)."""
        on_device = device is not None and device.type == "cuda" and not initialize
        config = self.config_at(layout, params_dtype=params_dtype, execution=execution, initialize=initialize,
                                on_device=on_device)
        if reseed or initialize:
            torch.manual_seed(seed)
        strides = None if initialize else self._strides()

        def build_one(stage: ChunkStage) -> torch.nn.Module:
            with device_kind(device if device is not None else "cpu").megatron_context():
                chunk = self._call(config, pg_collection, stage)
            if strides is not None:
                tag_tensor_parallel_weights(chunk, lambda name: strides.get(name, 1))
            return chunk

        model = build_chunks(layout, pg_collection.pp.rank(), build_one)
        if device is not None and device.type != "cpu":
            model = model.to(device)
        return model

    def _call(self, config: TransformerConfig, pg_collection: ProcessGroupCollection,
              stage: ChunkStage | None = None) -> torch.nn.Module:
        pp = pg_collection.pp
        stage = stage or ChunkStage(None, pp.rank() == 0, pp.rank() == pp.size() - 1)
        kwargs = dict(config=config, pg_collection=pg_collection, pre_process=stage.pre_process,
                      post_process=stage.post_process)
        accepted = inspect.signature(self.model_provider).parameters
        if "vp_stage" in accepted:
            kwargs["vp_stage"] = stage.vp_stage
        elif stage.vp_stage is not None:
            raise LayoutError(f"{self.name}: its model_provider takes no vp_stage, so it cannot build the model "
                              f"chunks of virtual pipeline stages",
                              hint="add a vp_stage argument passed on to megatron's module (GPTModel(vp_stage=...)), "
                                   "or use vpp1")
        return self.model_provider(**kwargs)

    def _strides(self) -> dict[str, int]:
        """Module name -> stride megatron's initialiser cuts its weight with (a factory's chunks)."""
        derived = self.derived()
        out = {}
        for t in derived.spec.tensors:
            chunking = derived.chunking.get(t.name)
            if chunking is not None and t.megatron_name.endswith(".weight"):
                out[t.megatron_name.removesuffix(".weight")] = chunking[1]
        return out

    # ------------------------------------------------------------------------------ description
    def derived(self) -> DerivedSpec:
        """The spec read from megatron's description (``vps.derive``), made once. Needs
        ``torch.distributed`` and megatron's groups initialised (the probes ask megatron for ranks)."""
        if not self._derived:
            from lightning_dynatrain.megatron.probe import probe_module
            from lightning_dynatrain.vps.derive import derive_spec

            def probe(layout: ParallelConfig, groups: ProcessGroupCollection) -> torch.nn.Module:
                config = self.config_at(layout, params_dtype=torch.bfloat16, execution=ExecutionOptions(),
                                        initialize=False)
                return self._call(config, groups)

            probes = probe_module(probe, has_experts=self.is_moe)
            sizes = dict(hidden=self.config.hidden_size, num_heads=self.config.num_attention_heads,
                         num_query_groups=self.config.num_query_groups or self.config.num_attention_heads,
                         head_dim=self.config.kv_channels or 0, ffn_hidden=self.config.ffn_hidden_size or 0,
                         moe_ffn_hidden=self.config.moe_ffn_hidden_size or 0)
            self._derived.append(derive_spec(self.name, probes, vocab=self.vocab, sizes=sizes))
        return self._derived[0]

    def spec(self) -> ModelSpec:
        return self.derived().spec

    @property
    def builds_beside_training(self) -> bool:
        """Whether the model can be built for another layout while training runs on the current one
        (ahead-of-time switches): not when a module reads megatron's parallel-state globals instead
        of the groups it is given (megatron-core 0.16's ``BertModel``), which are the current layout's."""
        return not self.derived().reads_globals


__all__ = ["ModelProvider", "padded_vocab_size"]
