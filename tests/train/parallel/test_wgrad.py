"""Weight-gradient accumulation fusion (:mod:`tokenloom.train.parallel.wgrad`): the linear's backward
against autograd's, the cases where it must fall back, and our DDP's sink on a 1-rank gloo
group (fresh writes, accumulation under no_sync, a declined write) against a model without DDP.
The scaled (world > 1) path is checked against torch DDP in test_ddp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.train.model.config import GPTConfig
from tokenloom.train.model.gpt import GPT
from tokenloom.train.parallel import wgrad
from tokenloom.train.parallel.ddp import DistributedDataParallel, wgrad_into_view
from tokenloom.train.parallel.wgrad import Linear, gemm_into, linear, set_wgrad_sink, wgrad_sink


def _inputs(bias: bool = True, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(6, 8, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=dtype, requires_grad=True) if bias else None
    up = torch.randn(3, 5, 6, generator=g, dtype=dtype)
    return x, w, b, up


def _reference(x, w, b, up):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    out = F.linear(*leaves)
    out.backward(up)
    return out.detach(), [t.grad for t in leaves]


class _BufferSink:
    """Writes the weight grad into ``buffer`` (accumulating), like our DDP's sink at world 1."""

    def __init__(self, shape, take: bool = True) -> None:
        self.buffer, self.take, self.calls = torch.zeros(shape), take, 0

    def __call__(self, grad_out, inp) -> bool:
        self.calls += 1
        if self.take:
            self.buffer.addmm_(grad_out.t(), inp)
        return self.take


@pytest.mark.parametrize("bias", [True, False])
def test_sink_gets_the_weight_grad_and_autograd_the_rest(bias):
    x, w, b, up = _inputs(bias)
    ref_out, ref_grads = _reference(x, w, b, up)
    sink = _BufferSink(w.shape)
    set_wgrad_sink(w, sink)
    out = linear(x, w, b)
    out.backward(up)
    assert sink.calls == 1
    assert w.grad is None  # taken by the sink
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(sink.buffer, ref_grads[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_grads[0], rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(b.grad, ref_grads[2], rtol=1e-6, atol=1e-6)


def test_a_declining_sink_leaves_the_grad_to_autograd():
    x, w, b, up = _inputs()
    _, ref_grads = _reference(x, w, b, up)
    sink = _BufferSink(w.shape, take=False)
    set_wgrad_sink(w, sink)
    linear(x, w, b).backward(up)
    assert sink.calls == 1
    torch.testing.assert_close(w.grad, ref_grads[1], rtol=1e-6, atol=1e-6)
    assert not sink.buffer.any()


class _ViewSink:
    """Our DDP's sink at world 1 (:func:`wgrad_into_view`): the GEMM writes the fp32 view."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.bucket = w, torch.full((w.numel() + 8,), float("nan"))  # stale: never read fresh
        self.view = self.bucket[4:4 + w.numel()].view_as(w)

    def __call__(self, grad_out, inp) -> bool:
        return wgrad_into_view(self.w, self.view, 1, grad_out, inp)


@pytest.mark.parametrize("out_dtype", [True, False])
def test_under_bf16_autocast_the_gemm_writes_fp32_main_grads(monkeypatch, out_dtype):
    """bf16 operands, fp32 bucket view: fresh and accumulated, against autograd's grads under the same
    autocast (bf16 weight grad cast to fp32) at bf16's tolerance; the forward is autocast's, bit for bit.
    ``out_dtype``: the device's mixed-precision addmm (faked on CPU: torch's CPU build lacks it) or the
    bf16 GEMM plus a cast-add."""
    if out_dtype:  # what CUDA's addmm(..., out_dtype=float32) computes: fp32 accumulation of bf16 operands
        real = torch.addmm

        def addmm(inp, a, b, *, out_dtype=None, beta, alpha, out):
            assert out_dtype == torch.float32 and a.dtype == torch.bfloat16 and inp is out
            return real(inp, a.float(), b.float(), beta=beta, alpha=alpha, out=out)

        monkeypatch.setattr(wgrad, "out_dtype_gemm", lambda device_type: True)
        monkeypatch.setattr(wgrad.torch, "addmm", addmm)
    x, w, b, up = _inputs()
    w_ref = w.detach().clone().requires_grad_()
    sink = _ViewSink(w)
    set_wgrad_sink(w, sink)
    for step in range(2):  # fresh (grad None), then accumulated into the view
        xs = x.detach().clone().requires_grad_()
        xr = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, ref = linear(xs, w, b), F.linear(xr, w_ref, b.detach())
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        out.float().backward(up * (step + 1))
        ref.float().backward(up * (step + 1))
        assert w.grad is sink.view and w.grad.dtype == torch.float32  # written by the GEMM, in the bucket
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=0)  # the input grad is autocast's
        assert xs.grad.dtype == torch.float32
    exact = sum((up * k).reshape(-1, 6).t().double() @ x.detach().to(torch.bfloat16).reshape(-1, 8).double()
                for k in (1, 2))
    # fp32 accumulation of the bf16 products: closer to the exact sum than autograd's bf16-rounded grads
    assert (w.grad.double() - exact).abs().max() <= (w_ref.grad.double() - exact).abs().max()


def test_gemm_into_keeps_fp32_operands_on_one_addmm():
    g = torch.Generator().manual_seed(3)
    a, bm = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g)
    out = torch.full((6, 4), float("nan"))
    gemm_into(out, a, bm, beta=0, alpha=0.5)
    torch.testing.assert_close(out, 0.5 * a @ bm, rtol=0, atol=0)
    gemm_into(out, a, bm, beta=0.5, alpha=0.5)
    torch.testing.assert_close(out, torch.addmm(0.5 * a @ bm, a, bm, beta=0.5, alpha=0.5), rtol=0, atol=0)
    assert not wgrad.out_dtype_gemm("cpu")  # torch's CPU build: the cast-add fallback is what runs here


def test_falls_back_to_autograd_where_the_fusion_cannot_apply():
    x, w, b, up = _inputs()
    sink = _BufferSink(w.shape)
    set_wgrad_sink(w, sink)
    with torch.no_grad():
        linear(x, w, b)
    set_wgrad_sink(w, None)
    assert wgrad_sink(w) is None
    w.grad = None
    linear(x, w, b).backward(up)
    assert sink.calls == 0 and w.grad is not None


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, make_vocab_size_divisible_by=32, seq_len=8, n_layers=2, n_heads=2,
                         d_model=16, tie_embeddings=True))


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (n, 2, 9), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


@pytest.mark.parametrize("zero_to_none", [True, False])
def test_ddp_sink_writes_block_weight_grads_into_the_buckets(group, zero_to_none):
    _ddp_sink_writes_block_weight_grads(torch.device("cpu"), zero_to_none)


@pytest.mark.parametrize("zero_to_none", [True, False])
def test_compiled_blocks_hand_their_weight_grads_to_the_sinks_too(group, zero_to_none):
    """With ``compile: true``'s compiled blocks the opaque backward op runs the same sinks:
    same calls, same grads as the eager plain model, with no graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _ddp_sink_writes_block_weight_grads(torch.device("cpu"), zero_to_none, compiled=True)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_under_bf16_autocast_block_weight_grads_go_into_the_fp32_buckets(group, compiled):
    """bf16 autocast on CPU (the cast-add path of gemm_into): the sinks take the block weights'
    grads, eager and from compiled blocks, within bf16's tolerance of the plain model's."""
    from torch._dynamo.utils import counters

    if compiled:
        torch._dynamo.reset()
    counters.clear()
    _ddp_sink_writes_block_weight_grads(torch.device("cpu"), True, compiled=compiled, autocast=True)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("zero_to_none", [True, False])
def test_on_cuda_the_ddp_sink_writes_block_weight_grads_into_the_buckets(nccl_group, zero_to_none, compiled,
                                                                          autocast):
    """The same on cuda:0 with NCCL: the GEMM writes the device bucket views, eager and from
    compiled blocks' backward op; under bf16 autocast with ``addmm(..., out_dtype=float32)``."""
    if compiled:
        torch._dynamo.reset()
    _ddp_sink_writes_block_weight_grads(nccl_group, zero_to_none, compiled=compiled, autocast=autocast)


def _ddp_sink_writes_block_weight_grads(device: torch.device, zero_to_none: bool, compiled: bool = False,
                                        autocast: bool = False) -> None:
    """Every block matmul's weight grad comes through the sink, into its bucket view, with
    the grads of the plain model (fresh and accumulated under no_sync); the tied head and
    embedding, biases and norms come through autograd. ``autocast``: both under bf16 autocast,
    compared at bf16's tolerance."""
    import contextlib
    plain, model = _gpt().to(device), _gpt().to(device)
    if compiled:
        model.compile_blocks()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01,
                                  grad_units=model.blocks.values() if compiled else ())
    assert all(b.buffer.device == device for b in ddp._buckets)
    calls: dict[str, int] = {}
    fused = {}
    for name, p in model.named_parameters():
        sink = wgrad_sink(p)
        assert sink is not None

        def counting(grad_out, inp, sink=sink, name=name):
            calls[name] = calls.get(name, 0) + 1
            return sink(grad_out, inp)

        set_wgrad_sink(p, counting)
        fused[name] = name.startswith("blocks.") and name.endswith(("qkv.weight", "proj.weight", "fc.weight"))
    for step in range(2):
        batches = _batches(3 * step + 3)[3 * step:]
        model.zero_grad(set_to_none=zero_to_none)
        plain.zero_grad()
        cast = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        for m, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            with cast:
                plain_loss = plain(x, y).div(3)
            plain_loss.backward()
            with ddp.no_sync() if m < 2 else contextlib.nullcontext():
                with cast:
                    loss = ddp(x, y).div(3)
                loss.backward()
        tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)
            assert p.grad.data_ptr() == ddp._views[list(dict(model.named_parameters())).index(name)].data_ptr()
    assert {n for n, f in fused.items() if f} == set(calls)
    assert all(c == 6 for c in calls.values())
    assert len(calls) == 2 * 4


def test_ddp_sink_declines_a_grad_that_is_not_its_view(group):
    model = _gpt()
    ddp = DistributedDataParallel(model)
    w = model.blocks["0"].attn.qkv.weight
    x, y = _batches(1)[0]
    w.grad = torch.zeros_like(w)  # a user's own tensor, not the bucket view
    ddp(x, y).backward()
    assert w.grad.data_ptr() == ddp._views[[id(p) for p in model.parameters()].index(id(w))].data_ptr()
    plain = _gpt()
    plain(x, y).backward()
    torch.testing.assert_close(w.grad, plain.blocks["0"].attn.qkv.weight.grad, rtol=1e-5, atol=1e-6)


def test_remove_hooks_removes_the_sinks(group):
    model = _gpt()
    ddp = DistributedDataParallel(model)
    assert all(wgrad_sink(p) is not None for p in model.parameters())
    ddp.remove_hooks()
    assert all(wgrad_sink(p) is None for p in model.parameters())
    unfused = _gpt()
    DistributedDataParallel(unfused, wgrad_fusion=False)
    assert all(wgrad_sink(p) is None for p in unfused.parameters())


@pytest.mark.parametrize("weight_norm", [False, True])
def test_compiled_weight_without_a_sink_gets_autograds_grad_while_sinks_exist(weight_norm):
    """While sinks exist in the process, a compiled graph routes a leaf weight's grad through
    the opaque op: one without a sink gets it accumulated into ``.grad`` as autograd would
    (two backwards: fresh, then accumulated). A weight computed in the forward (weight
    norm's) has no ``.grad`` of its own and must keep autograd's path."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin, ref = Linear(8, 8), Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    if weight_norm:
        for m in (lin, ref):
            torch.nn.utils.parametrizations.weight_norm(m)
    elsewhere = torch.nn.Parameter(torch.zeros(2))
    set_wgrad_sink(elsewhere, _BufferSink((2,)))
    try:
        compiled = torch.compile(lin)
        for seed in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
            compiled(x).sum().backward()
            ref(x.detach().requires_grad_()).sum().backward()
    finally:
        set_wgrad_sink(elsewhere, None)
    for (name, p), q in zip(lin.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_a_tied_weight_gets_autograds_grads_bit_for_bit_summed_into_the_heads_own_tensor(autocast):
    """The LM head (``wgrad_fusion`` off) tied to an embedding: output and gradients equal
    ``F.linear``'s exactly, and the embedding's gradient is added into the head's weight gradient
    in place (``weight.grad`` is that tensor), not into a third weight-sized one (under autocast
    ``F.linear``'s did too: its gradient cast back to fp32 is a tensor of its own)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (2, 6), generator=g)
    up = torch.randn(2, 6, 40, generator=g)
    results = []
    for shared in (True, False):
        torch.manual_seed(0)
        emb, head = torch.nn.Embedding(40, 8), Linear(8, 40, bias=False)
        head.wgrad_fusion = False
        head.weight = emb.weight
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x = emb(tokens) * 2.0
            out = head(x) if shared else F.linear(x, head.weight)
        head_grad = _watch_first_grad_into(out, emb.weight)
        out.float().backward(up)
        results.append((out.detach(), emb.weight.grad, head_grad == [emb.weight.grad.data_ptr()]))
    (out, grad, summed_in_place), (ref_out, ref_grad, _) = results
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    assert summed_in_place


def _watch_first_grad_into(out: torch.Tensor, leaf: torch.Tensor) -> list[int]:
    """A list that the backward of ``out`` fills with the address of the gradient for ``leaf``
    from the autograd node nearest ``out`` that feeds ``leaf`` (the head's, here)."""
    seen, frontier, addresses = set(), [out.grad_fn], []
    while frontier:
        node = frontier.pop(0)
        for i, (child, _) in enumerate(node.next_functions):
            if child is not None and getattr(child, "variable", None) is leaf:
                node.register_hook(lambda grad_inputs, _, i=i: addresses.append(grad_inputs[i].data_ptr()))
                return addresses
            if child is not None and child not in seen:
                seen.add(child)
                frontier.append(child)
    raise AssertionError("no node feeds the leaf")
