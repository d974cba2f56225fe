"""Peak-memory probe for one cross-entropy implementation, run as a fresh subprocess.

Usage: ``python _ce_memory_probe.py {reference|chunked} TOKENS VOCAB HIDDEN [CHUNK]``.
Prints one JSON line: ``peak_rss_delta`` and ``held_after_forward`` (bytes).

* ``peak_rss_delta``: the kernel's peak-RSS counter (VmHWM) is reset through
  ``/proc/self/clear_refs`` after inputs are built and a tiny warm-up ran; the
  difference between VmHWM after forward+backward and VmRSS before it is the extra
  memory the loss needed at its worst moment, transients included. The parent sets
  ``MALLOC_MMAP_THRESHOLD_`` so every large buffer is its own mmap, returned to the
  OS when freed (glibc otherwise raises the threshold dynamically and recycles heap
  memory, which blurs the measurement).
* ``held_after_forward``: VmRSS after forward minus VmRSS before it: everything kept
  from forward to backward (saved activations, and the gradients the training path of
  the chunked loss computes in forward), which ``saved_tensors_hooks`` alone would miss.
"""

from __future__ import annotations

import json
import sys

import torch

from tokenloom.train.kernels.cross_entropy import chunked_cross_entropy, cross_entropy_reference


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    mode, tokens, vocab, hidden = sys.argv[1], *map(int, sys.argv[2:5])
    chunk = int(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    fn = (
        cross_entropy_reference
        if mode == "reference"
        else lambda *a: chunked_cross_entropy(*a, chunk_size=chunk)
    )
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).requires_grad_()
    t = torch.randint(0, vocab, (1, tokens), generator=g)
    fn(h[:, :4].detach().requires_grad_(), w[:8].detach().requires_grad_(), t[:, :4] % 8).backward()


    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    loss = fn(h, w, t)
    held = _status("VmRSS") - before
    loss.backward()
    print(json.dumps({"peak_rss_delta": _status("VmHWM") - before, "held_after_forward": held}))


if __name__ == "__main__":
    main()
