"""Our pipeline split (:class:`tokenloom.train.model.pipeline_split.PipelineSplit`) against megatron-core's
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` on a grid of layouts: even,
first/last stage layers, embedding and loss counted as layers, with and without vpp.

megatron-core is a test-only oracle, imported once for the module.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tl_testing import import_megatron

from tokenloom.errors import TokenloomError
from tokenloom.train.model.pipeline_split import PipelineSplit

block = import_megatron("megatron.core.transformer.transformer_block")
layer = import_megatron("megatron.core.transformer.transformer_layer")
mconfig = import_megatron("megatron.core.transformer.transformer_config")


def megatron_layer_ids(n, p, v, first, last, emb, loss) -> list[list[list[int]]] | str | None:
    """[chunk][rank] -> block ids by megatron-core; None where it rejects the split, "crash" where
    it divides by zero (0.16.1's interleaved offset with both ends set and no middle rank)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = mconfig.TransformerConfig(
                num_layers=n, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=p,
                virtual_pipeline_model_parallel_size=v if v > 1 else None, pipeline_dtype=torch.float32,
                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
            out = []
            for c in range(v):
                row = []
                for r in range(p):
                    vp = c if v > 1 else None
                    count = block.get_num_layers_to_build(cfg, vp, r)
                    if count < 0:  # its config check lets first + last > n_layers through
                        return None
                    offset = layer.get_transformer_layer_offset(cfg, vp, r)
                    row.append(list(range(offset, offset + count)))
                out.append(row)
            return out
    except (ValueError, AssertionError):
        return None
    except ZeroDivisionError:
        return "crash"


GRID = [(n, p, v, first, last, emb, loss)
        for n in (4, 5, 6, 7, 8, 12)
        for p in (2, 3, 4)
        for v in (1, 2)
        for first, last, emb, loss in [(None, None, False, False), (None, None, True, False), (None, None, False, True),
                                       (None, None, True, True), (2, None, False, False), (None, 2, False, False),
                                       (2, 2, False, False), (4, 2, False, False), (1, 3, False, False)]]


def test_interop_pipeline_split_equals_megatron_core():
    compared = rejected = crashed = 0
    for n, p, v, first, last, emb, loss in GRID:
        ref = megatron_layer_ids(n, p, v, first, last, emb, loss)
        if ref == "crash":  # ours still deals every block once, in order, with the ends' counts
            split = PipelineSplit(n, p, v, first, last, emb, loss)
            ours = [split.layer_ids(r, c) for c in range(v) for r in range(p)]
            assert [i for ids in ours for i in ids] == list(range(n))
            assert sum(len(split.layer_ids(0, c)) for c in range(v)) == first
            assert sum(len(split.layer_ids(p - 1, c)) for c in range(v)) == last
            crashed += 1
            continue
        if ref is None:
            with pytest.raises(TokenloomError):
                PipelineSplit(n, p, v, first, last, emb, loss)
            rejected += 1
            continue
        split = PipelineSplit(n, p, v, first, last, emb, loss)
        ours = [[split.layer_ids(r, c) for r in range(p)] for c in range(v)]
        assert ours == ref, (n, p, v, first, last, emb, loss)
        assert sorted(i for row in ours for ids in row for i in ids) == list(range(n))  # each block once
        compared += 1
    assert compared > 100 and rejected > 50 and crashed, (compared, rejected, crashed)
