"""Named RNG streams for dropout under tensor parallelism, on CPU and CUDA (Megatron-core's
``tensor_parallel/random.py``).

:func:`model_parallel_manual_seed` seeds the default generator with ``seed`` (equal across tp, so
dropout on replicated activations agrees) and the stream ``"model-parallel-rng"`` with ``seed +
2718 + tp_rank`` (differs across tp); callers pass ``base + 100 * pp_rank`` as Megatron does.
``tracker.fork()`` swaps that stream into the default generator for dropout on tensors *split* over
tp; unlike Megatron's it works on CPU too. The swap is global (``F.dropout`` takes no generator): never
fork a stream from two threads. Recompute replays the streams (:func:`checkpoint`, Megatron's way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint

from tokenloom.errors import TokenloomError

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the stream that differs across tensor-parallel ranks (Megatron's name)."""

MODEL_PARALLEL_SEED_OFFSET = 2718
"""Megatron's offset between the default seed and the model-parallel stream's seed."""


class RNGStatesTracker:
    """Named RNG states for one device type; ``fork(name)`` runs a block under one of them."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise TokenloomError(f"RNG tracker supports cpu and cuda devices, got {self.device}")
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed``; the default generator is left unchanged."""
        if seed in self._seeds:
            raise TokenloomError(f"RNG seed {seed} is already used by another stream")
        if name in self._states:
            raise TokenloomError(f"RNG stream {name!r} already exists")
        self._states[name] = torch.Generator(self.device).manual_seed(seed).get_state()
        self._seeds.add(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and recompute)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with stream ``name`` as the default generator's state."""
        if name not in self._states:
            raise TokenloomError(f"RNG stream {name!r} is not set up; call model_parallel_manual_seed first")
        outer = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(outer)


_default_trackers: dict[str, RNGStatesTracker] = {}


def get_rng_tracker(device: torch.device | str | None = None) -> RNGStatesTracker:
    """The process-wide tracker for ``device``'s type (cuda when available, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind not in _default_trackers:
        _default_trackers[kind] = RNGStatesTracker(kind)
    return _default_trackers[kind]


def model_parallel_manual_seed(
    seed: int, tp_rank: int, tracker: RNGStatesTracker | None = None
) -> RNGStatesTracker:
    """Seed default generator and model-parallel stream (Megatron's ``model_parallel_cuda_manual_seed``)
    on ``tracker``'s device only; resets and returns the tracker (default: the process-wide one)."""
    tracker = tracker or get_rng_tracker()
    if tracker.device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def checkpoint(function: Callable, *args, tracker: RNGStatesTracker | None = None, **kwargs):
    """Non-reentrant ``torch.utils.checkpoint`` that also replays the tracker's named streams
    (torch replays the default one), so dropout inside ``fork()`` redraws the same masks."""
    tracker = tracker or get_rng_tracker()
    snapshot: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward_ctx() -> Iterator[None]:
        snapshot.update(tracker.get_states())
        yield

    @contextlib.contextmanager
    def recompute_ctx() -> Iterator[None]:
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            yield
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=lambda: (forward_ctx(), recompute_ctx()), **kwargs
    )
