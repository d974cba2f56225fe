"""Best-fit packed data (``data.packing: best-fit``, inter-document masking on by default)
through the one loop in dp2, tp2 + sequence parallel, pp2 and cp2 against its one-process run:
losses, grad norms and final parameters within TOL (fp32, gloo). The samples hold several
documents and padding, and documents cross cp2's chunk boundaries (checked on the data).

One launch of 2 gloo ranks runs the four layouts (one module fixture), so the module is ``slow``."""

from __future__ import annotations

import numpy as np
import pytest
from compose_helpers import (
    assert_losses_norms_params_match,
    launch,
    launches_timeout,
    reference,
)

from tokenloom.blending.blend import build_mock_datasets
from tokenloom.blending.gpt import GPTDatasetConfig
from tokenloom.blending.mock import MockSource
from tokenloom.train.data import DataConfig, MockDataConfig
from tokenloom.train.model.config import GPTConfig

# one launch of four 4-step runs at 2 ranks and the one-process reference: about 20 s on a quiet 2-core box

TOL = 1e-5
STEPS = 4
SEQ = 16
MOCK = dict(num_sequences=400, max_length=12, content="random")

LAYOUTS = {
    "dp2": dict(),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
}
pytestmark = [pytest.mark.slow, launches_timeout(len(LAYOUTS))]


def _kw(**kw) -> dict:
    """tiny_cfg's run on best-fit packed mock data, with two of its four layers (pp2 takes one each)."""
    data = DataConfig(mock=MockDataConfig(**MOCK), packing="best-fit")
    model = GPTConfig(bias=False, vocab_size=64, make_vocab_size_divisible_by=64, seq_len=SEQ, n_layers=2, n_heads=4,
                      d_model=32)
    return dict(model=model, data=data, train_iters=STEPS, eval_interval=2, eval_iters=1, **kw)


def test_the_data_is_packed_and_documents_cross_cp2_chunks():
    """The runs' train samples: padded, several documents each, and documents that span the
    boundary between cp2's chunks (every SEQ / 4 tokens)."""
    assert DataConfig(mock=MockDataConfig(**MOCK), packing="best-fit").inter_document_masking is True
    source = MockSource(64, 63, seed=0, **MOCK)  # the loop's mock source: vocab 64, eod vocab - 1
    train, _, _ = build_mock_datasets(GPTDatasetConfig(seq_length=SEQ, split="1,1,1", packing="best-fit"),
                                      (STEPS * 8, 8, 0), source)
    pieces = [train.documents_of(k)[1] for k in range(STEPS * 8)]
    assert sum(len(p) >= 2 for p in pieces) > STEPS * 4
    assert any(train.documents_of(k)[0][-1] == -1 for k in range(STEPS * 8))
    crossing = [k for k, p in enumerate(pieces)
                if any(s // (SEQ // 4) != (e - 1) // (SEQ // 4) for s, e in zip(np.cumsum(p) - p, np.cumsum(p),
                                                                                  strict=True) if e <= SEQ)]
    assert len(crossing) > STEPS * 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packing")
    scenarios = [("train", dict(_kw(**kw), out=str(tmp / name))) for name, kw in LAYOUTS.items()]
    results = launch(scenarios, 2, tmp)
    out = {name: [rank[i] for rank in results] for i, name in enumerate(LAYOUTS)}
    return out, reference(tmp / "ref", **_kw())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(runs, name):
    results, ref = runs
    assert_losses_norms_params_match(results[name], ref, STEPS, TOL)
