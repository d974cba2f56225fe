"""In-process checks of our DDP on a 1-rank gloo group: launch order, overlap with
backward, no_sync, grads as bucket views, ignore list, user errors, completion after an
engine-direct backward and the deferred finish_grad_sync."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tokenloom.errors import TokenloomError
from tokenloom.train.dist import init_from_env
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel.ddp import DistributedDataParallel
from tokenloom.train.parallel.schedules import backward_from, release_output


def mlp(n: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


def test_buckets_launch_in_order_during_backward(group, monkeypatch):
    model = mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02, rebuild_buckets=False)
    events = []
    real = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append(("launch", tensor.data_ptr()))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
    for p in model.parameters():  # registered after DDP's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", p.data_ptr())))
    ddp(torch.randn(3, 64)).sum().backward()

    launches = [ptr for kind, ptr in events if kind == "launch"]
    assert launches == [b.buffer.data_ptr() for b in ddp._buckets]
    assert len(launches) == len(ddp.bucket_indices) > 2
    first_launch = events.index(("launch", launches[0]))
    last_grad = max(i for i, (kind, _) in enumerate(events) if kind == "grad")
    assert first_launch < last_grad  # communication starts while backward is still running
    # Reverse definition order: the last-defined param is in the first bucket.
    assert 11 in ddp.bucket_indices[0] and 0 in ddp.bucket_indices[-1]


def test_no_sync_accumulates_without_communication(group, monkeypatch):
    model = mlp(2)
    ddp = DistributedDataParallel(model)
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    x = torch.randn(3, 64)
    with ddp.no_sync():
        ddp(x).sum().backward()
    assert calls == []
    ddp(x).sum().backward()
    assert len(calls) == len(ddp.bucket_indices)
    ref = mlp(2)
    (ref(x).sum() * 2).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_grads_are_views_into_bucket_after_set_to_none(group):
    model = mlp(3)
    ddp = DistributedDataParallel(model, rebuild_buckets=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        ddp(torch.randn(2, 64)).sum().backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert storages == {b.buffer.untyped_storage().data_ptr() for b in ddp._buckets}


def test_ignored_parameters_are_not_reduced(group):
    model = mlp(2)
    ddp = DistributedDataParallel(model, params_and_buffers_to_ignore=["0.weight"])
    assert "0.weight" not in ddp.param_names and len(ddp.param_names) == 3
    ddp(torch.randn(2, 64)).sum().backward()
    assert model[0].weight.grad is not None  # plain local grad
    assert all(model[0].weight.grad.data_ptr() != b.buffer.data_ptr() for b in ddp._buckets)


def test_sparse_embedding_is_a_user_error(group):
    with pytest.raises(TokenloomError, match="sparse"):
        DistributedDataParallel(nn.Embedding(10, 4, sparse=True))


def test_rebuild_follows_ready_order(group):
    """A model whose forward uses its layers in reverse definition order."""

    class Backwards(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = mlp(4)

        def forward(self, x):
            for layer in reversed(self.layers):
                x = layer(x)
            return x.sum()

    model = Backwards()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    before = ddp.bucket_indices
    for _ in range(2):
        ddp(torch.randn(2, 64)).backward()
    after = ddp.bucket_indices
    assert before[0][0] > before[-1][0]  # initial: reverse definition order
    assert after[0][:2] == [1, 0]  # rebuilt: layer 0 ran last, so its grads are ready first


def test_init_from_env_requires_launcher_vars(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TokenloomError, match="torchrun"):
        init_from_env()


class MixedPrecision(nn.Module):
    """fp32 -> fp64 -> bf16 layers: three bucket keys."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.a(x).double())
        return self.c(x.to(torch.bfloat16)).float().sum()


def test_mixed_dtypes_get_separate_buckets(group):
    model, ref = MixedPrecision(), MixedPrecision()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)
    x = torch.randn(2, 8)
    ddp(x).backward()
    ref(x).backward()
    for b in ddp._buckets:
        assert {ddp._params[i].dtype for i in b.indices} == {b.buffer.dtype}
    assert {b.buffer.dtype for b in ddp._buckets} == {torch.float32, torch.float64, torch.bfloat16}
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_find_unused_sees_through_activation_recompute(group):
    """Non-reentrant checkpoint keeps params reachable in the graph: nothing is
    wrongly marked unused (it would then be reported as getting its grad twice)."""
    cfg = GPTConfig(vocab_size=50, seq_len=8, n_layers=2, n_heads=2, d_model=16, recompute_layers=(0, 1))
    model, ref = GPT(cfg), GPT(cfg)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    tokens = torch.randint(0, 50, (2, 8))
    ddp(tokens, tokens).backward()
    ref(tokens, tokens).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _backward_nodes(loss: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _eager_and_compiled() -> tuple[GPTConfig, GPT, GPT]:
    """A 3-block GPT twice with the same weights, the second with its blocks compiled."""
    cfg = GPTConfig(vocab_size=64, make_vocab_size_divisible_by=64, seq_len=16, n_layers=3, n_heads=2, d_model=32)
    torch.manual_seed(0)
    eager, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(eager.state_dict())
    model.compile_blocks()
    return cfg, eager, model


def _assert_eager_grads(model: GPT, eager: GPT, x: torch.Tensor) -> None:
    """``model``'s grads (its backward on ``x`` already ran) equal the eager model's on ``x``."""
    eager(x[:, :-1], x[:, 1:]).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_blocks_keep_bucket_overlap_and_the_eager_gradients(group):
    """``compile: true`` compiles block by block (GPT.compile_blocks): the backward keeps one
    compiled node per block (a whole-model graph has one, and every bucket would wait for its
    end), so buckets are reduced while earlier blocks are in backward; the gradients are the
    eager model's. The loss is one more compiled node, with no parameters of its own."""
    cfg, eager, model = _eager_and_compiled()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, rebuild_buckets=False)
    x = torch.randint(0, 64, (2, 17))
    loss = ddp(x[:, :-1], x[:, 1:])
    compiled = [name for name in _backward_nodes(loss) if "Compiled" in name]
    assert len(compiled) == cfg.n_layers + 1, compiled
    assert len(ddp.bucket_indices) > 2
    loss.backward()
    _assert_eager_grads(model, eager, x)


def test_compiled_blocks_as_grad_units_are_never_split_across_buckets(group):
    """With ``grad_units`` (the strategy passes the compiled blocks), no bucket ends inside a
    block, before and after the rebuild from the ready order: a bucket that did would wait for
    the rest of the block's one backward node and hold back the buckets after it. Without
    them, the same caps split blocks; the gradients are the eager model's either way."""
    _, eager, model = _eager_and_compiled()
    plain = DistributedDataParallel(model, bucket_cap_mb=0.01, init_sync=False)
    plain.remove_hooks()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01, grad_units=model.blocks.values())
    block_of = [n.split(".")[1] if n.startswith("blocks.") else None for n in ddp.param_names]

    def split_blocks(d):
        seen = [{block_of[i] for i in b} - {None} for b in d.bucket_indices]
        return [blk for blk in {b for s in seen for b in s} if sum(blk in s for s in seen) > 1]

    assert split_blocks(plain), "the caps are small enough to split blocks without units"
    x = torch.randint(0, 64, (2, 17))
    for step in range(2):  # the second forward rebuilds the buckets from the first's ready order
        assert split_blocks(ddp) == [], (step, ddp.bucket_indices)
        for p in model.parameters():
            p.grad = None
        ddp(x[:, :-1], x[:, 1:]).backward()
    assert split_blocks(ddp) == []
    _assert_eager_grads(model, eager, x)


def with_unused(model: nn.Module) -> nn.Module:
    model.register_parameter("unused", nn.Parameter(torch.zeros(3)))  # no forward reads it
    return model


def test_completion_callback_runs_after_an_engine_direct_backward(group):
    """The pipeline schedules backprop a freed stage output through the autograd engine's
    ``run_backward`` (``backward_from``); the callback DDP queues from its hooks runs at the end
    of that backward as well: averaged grads on return, and a missing grad raised there."""
    x, dy = torch.randn(3, 64), torch.randn(3, 64)
    model, ref = mlp(2), mlp(2)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
    y = ddp(x)
    release_output(y)
    backward_from(y, dy)
    ref(x).backward(dy)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    ddp = DistributedDataParallel(with_unused(mlp(2)))
    y = ddp(x)
    release_output(y)
    with pytest.raises(TokenloomError, match=r"received no gradient in this backward: \['unused'\]"):
        backward_from(y, dy)


def test_deferred_finish_launches_in_backward_and_waits_in_finish_grad_sync(group, monkeypatch):
    """finish_in_backward=False (the strategy's tp/pp layouts): buckets launch during backward,
    which returns without waiting; finish_grad_sync() waits and checks, once; a forward before
    it is refused."""
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    x = torch.randn(3, 64)
    model, ref = mlp(3), mlp(3)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02, finish_in_backward=False)
    ddp(x).sum().backward()
    assert len(calls) == len(ddp.bucket_indices) > 1
    with pytest.raises(TokenloomError, match="call finish_grad_sync"):
        ddp(x)
    ddp.finish_grad_sync()
    ddp.finish_grad_sync()  # nothing left to wait for
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    ddp = DistributedDataParallel(with_unused(mlp(2)), finish_in_backward=False)
    ddp(x).sum().backward()
    with pytest.raises(TokenloomError, match=r"received no gradient in this backward: \['unused'\]"):
        ddp.finish_grad_sync()


def _trainer_pattern_equals_torch_ddp(device: torch.device, find_unused: bool, compiled: bool) -> None:
    """Through the trainer's pattern (``zero_grad()`` to None, a ``no_sync`` micro-batch, then a
    synced one, bf16 autocast, three SGD steps): the buckets live on ``device``, grads are
    views into them, and every grad and parameter equals torch DDP's."""
    cfg = GPTConfig(vocab_size=256, make_vocab_size_divisible_by=128, seq_len=64, n_layers=3, n_heads=4, d_model=128)
    torch.manual_seed(0)
    ours, ref = GPT(cfg).to(device), GPT(cfg).to(device)
    ref.load_state_dict(ours.state_dict())
    if find_unused:
        ours, ref = with_unused(ours).to(device), with_unused(ref).to(device)
    if compiled:
        ours.compile_blocks()
        ref.compile_blocks()
    ddp = DistributedDataParallel(ours, bucket_cap_mb=0.25, find_unused_parameters=find_unused)
    tddp = nn.parallel.DistributedDataParallel(ref, bucket_cap_mb=0.25, find_unused_parameters=find_unused)
    assert len(ddp.bucket_indices) >= 4
    assert all(b.buffer.device == device for b in ddp._buckets)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]  # AdamW would amplify ulps of tiny grads
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        for micro in range(2):
            x = torch.randint(0, 256, (2, 65), device=device, generator=g)
            for wrapper in (ddp, tddp):
                with wrapper.no_sync() if micro == 0 else nullcontext():
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = wrapper(x[:, :-1], x[:, 1:])
                    loss.backward()
        for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
            if name == "unused":
                assert p.grad is None and q.grad is None
                continue
            start = p.grad.data_ptr()
            assert any(b.buffer.data_ptr() <= start < b.buffer.data_ptr() + b.buffer.nbytes for b in ddp._buckets), name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        for opt in opts:
            opt.step()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("find_unused", [False, True])
def test_trainer_pattern_equals_torch_ddp(group, find_unused):
    _trainer_pattern_equals_torch_ddp(torch.device("cpu"), find_unused, compiled=False)


@pytest.mark.gpu
@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_with_nccl_the_trainer_pattern_equals_torch_ddp(nccl_group, find_unused, compiled):
    """The same on cuda:0 with NCCL, eager and with compiled blocks: a hook that copied, scaled
    or accumulated on the wrong device or stream would differ from torch DDP's grads."""
    _trainer_pattern_equals_torch_ddp(nccl_group, find_unused, compiled)
