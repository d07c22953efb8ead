"""The third-party warning filters: each names a category, a module and a message (no blanket filter),
hides exactly its warning, and the GPU-relevant one stays on GPUs; each logged-notice filter hides its
notice on its logger only."""

from __future__ import annotations

import logging
import warnings

import pytest

from lightning_dynatrain.warning_filters import THIRD_PARTY, THIRD_PARTY_LOGS, quiet_third_party_warnings


def _shown(category, message, module, *, on_cpu=True) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet_third_party_warnings(on_cpu=on_cpu)
        warnings.warn_explicit(message, category, filename="x.py", lineno=1, module=module)
    return bool(seen)


@pytest.mark.parametrize("quiet", THIRD_PARTY, ids=lambda q: q.message[:40])
def test_each_filter_is_named_and_narrow(quiet) -> None:
    assert quiet.category is not Warning and quiet.module and len(quiet.message) >= 20 and len(quiet.why) >= 40
    module = quiet.module.strip("^()").split("|")[0].replace("\\.", ".").rstrip(".") + ".x"
    assert not _shown(quiet.category, quiet.message + " (and the rest)", module)
    assert _shown(quiet.category, "something else entirely", module), "the message must match, not the module alone"
    assert _shown(quiet.category, quiet.message, "lightning_dynatrain.strategy.dynatrain"), "only its own module"


def test_cuda_advice_stays_on_gpus() -> None:
    cuda = next(q for q in THIRD_PARTY if q.cpu_only)
    assert not _shown(cuda.category, cuda.message, "megatron.core.tensor_parallel.layers", on_cpu=True)
    assert _shown(cuda.category, cuda.message, "megatron.core.tensor_parallel.layers", on_cpu=False)


@pytest.mark.parametrize("quiet", THIRD_PARTY_LOGS, ids=lambda q: q.message[:40])
def test_each_log_filter_hides_its_notice_on_its_logger_only(quiet, caplog) -> None:
    quiet_third_party_warnings(on_cpu=True)
    quiet_third_party_warnings(on_cpu=True)
    assert logging.getLogger(quiet.logger).filters.count(quiet) == 1, "installed once"
    assert len(quiet.why) >= 40
    with caplog.at_level(logging.WARNING):
        logging.getLogger(quiet.logger).warning(quiet.message + " (and the rest)")
        logging.getLogger(quiet.logger).warning("something else entirely")
        logging.getLogger("lightning_dynatrain.strategy.dynatrain").warning(quiet.message)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        (quiet.logger, "something else entirely"), ("lightning_dynatrain.strategy.dynatrain", quiet.message)]
