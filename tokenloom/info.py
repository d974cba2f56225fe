"""What ``tokenloom info`` reports: versions, the native extension, torch devices and backends."""

from __future__ import annotations

import importlib.metadata
import platform

from tokenloom import __version__, native

PACKAGES = ("torch", "numpy", "tokenizers", "sentencepiece", "tiktoken", "datasets", "pyarrow",
            "zstandard", "click", "megatron-core")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict[str, str]:
    """Facts as ordered (label, value) pairs; importing torch is the slow part."""
    import torch  # lazy: start-up time, torch loads only when the facts are collected
    import torch.distributed as dist  # lazy: start-up time, torch loads only when the facts are collected

    facts = {"tokenloom": __version__, "python": platform.python_version(),
             "platform": platform.platform()}
    facts.update({name: _version(name) for name in PACKAGES})
    facts["native extension"] = native.describe()
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    facts["torch devices"] = ", ".join(devices)
    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())) if ok]
    facts["distributed backends"] = ", ".join(backends) or "none"
    facts["torch threads"] = str(torch.get_num_threads())
    return facts
