"""keep_freed_memory: freed tensor memory is reused instead of faulted in again.

Counted, not timed: minor page faults per training step of a small GPT, in fresh
interpreters (the setting is process-wide), with and without the tuning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tl_testing import limit_s

from tokenloom.train.config import TrainConfig

PROBE = r"""
import json, resource, sys
import torch
from tokenloom.train.host_alloc import keep_freed_memory
from tokenloom.train.model.gpt import GPT
from tokenloom.train.model.config import GPTConfig
applied = keep_freed_memory() if sys.argv[1] == "on" else False
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=4096, seq_len=256, n_layers=2, n_heads=4, d_model=256))
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 4096, (8, 257))
faults = []
for _ in range(8):  # training steps: activations and gradients freed and re-allocated each step
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    opt.zero_grad()
    model(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=limit_s(120))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    off, on = _probe("off"), _probe("on")
    if not on["applied"]:
        pytest.skip("the C library is not glibc (or refused mallopt): nothing to tune")
    logits_pages = 8 * 256 * 4096 * 4 // 4096  # one step's fp32 logits alone
    steady_off, steady_on = off["faults"][3:], on["faults"][3:]
    assert min(steady_off) > logits_pages, off  # untuned: every step faults its activations in again
    # tuned: reused after warm-up (measured 0-1 faults in most steps, now and then one new block)
    assert sum(steady_on) * 4 < sum(steady_off), (on, off)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_is_on_by_default_applies_on_glibc_and_once():
    """On by default; on glibc the call applies the setting (True) and later calls return the
    first answer without calling mallopt again (memoised: process-wide state)."""
    assert TrainConfig().keep_freed_memory
    out = subprocess.run([sys.executable, "-c", (
        "import ctypes, platform; from tokenloom.train import host_alloc as h; "
        "print(platform.libc_ver()[0], h.keep_freed_memory(), h.keep_freed_memory(), "
        "h.keep_freed_memory.cache_info().misses)")], capture_output=True, text=True, check=True, timeout=limit_s(60))
    libc, first, second, calls = out.stdout.split()
    assert calls == "1" and first == second
    assert first == ("True" if libc == "glibc" else "False")


RELEASE_PROBE = r"""
import json, os, sys
import torch
from tokenloom.train.host_alloc import release_large_blocks
def resident():
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
applied = release_large_blocks() if sys.argv[1] == "on" else False
before = resident()
for _ in range(4):  # a gather's pattern: a large block, a small long-lived one, the large one freed
    big = torch.ones(4 << 20)  # 16 MiB: under glibc's dynamic threshold's 32 MiB ceiling
    keep = [torch.ones(1024) for _ in range(64)]
    del big
print(json.dumps({"applied": applied, "grown": resident() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_release_large_blocks_returns_freed_large_blocks_to_the_os():
    """fsdp's tuning: a freed 16 MiB block is unmapped at once (the resident memory does not
    keep it), where glibc's dynamic threshold heap-allocates the later ones and keeps them."""
    off, on = (json.loads(subprocess.run([sys.executable, "-c", RELEASE_PROBE, mode], capture_output=True, text=True,
                                         check=True, timeout=limit_s(120)).stdout.strip().splitlines()[-1])
               for mode in ("off", "on"))
    if not on["applied"]:
        pytest.skip("the C library is not glibc (or refused mallopt): nothing to tune")
    assert off["grown"] >= 8 << 20, off  # untuned: a freed block stays resident
    assert on["grown"] < 4 << 20, on
