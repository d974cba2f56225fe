"""The native extension is an accelerator: without it tokenloom works, with one clear warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from tl_testing import REPO, limit_s

from tokenloom import native

WITHOUT_EXTENSION = textwrap.dedent(
    """
    import importlib.abc, sys, warnings

    class Block(importlib.abc.MetaPathFinder):  # as if no compiler was there at install time
        def find_spec(self, name, path=None, target=None):
            if name == "tokenloom._native":
                raise ImportError("blocked for the test")

    sys.meta_path.insert(0, Block())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import numpy as np
        from tokenloom import native
        from tokenloom.blending import helpers
        di, dsi = helpers.blending_indices([0.25, 0.75], 8)
        sample = helpers.build_sample_idx(np.full(4, 5, np.int32), np.arange(4, dtype=np.int32), 4, 1, 20)
    assert not native.loaded()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    print(len(messages), messages[0] if messages else "")
    print(di.tolist(), dsi.tolist(), sample.tolist())
    """
)


# Derived by hand. Blending (Megatron's greedy rule): at step i pick the dataset with the
# largest weight * max(i, 1) - count so far, the first on ties: i=0 (.25,.75) -> 1; i=1
# (.25,-.25) -> 0; i=2 (-.5,.5) -> 1; i=3 (-.25,.25) -> 1; i=4 (0,0) -> 0; i=5..7 -> 1; each
# pick's sample index counts that dataset's picks. Sample index: 4 documents of 5 tokens,
# samples of 4+1 tokens overlapping by one, so a sample starts every 4 tokens of the
# 20-token stream: positions 0, 4, 8, 12, 16 = (document, offset) (0,0) (0,4) (1,3) (2,2) (3,1).
EXPECTED = "[1, 0, 1, 1, 0, 1, 1, 1] [0, 0, 1, 2, 1, 3, 4, 5] [[0, 0], [0, 4], [1, 3], [2, 2], [3, 1]]"


def test_works_without_the_extension_with_one_warning():
    out = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSION], capture_output=True, text=True, cwd=REPO,
                         timeout=limit_s(120))
    assert out.returncode == 0, out.stderr
    count_line, result_line = out.stdout.strip().splitlines()
    assert count_line.startswith("1 ") and "native extension unavailable" in count_line
    assert result_line == EXPECTED


def test_the_extension_is_built_and_gives_the_same_answer():
    """The install builds it (setup.py only warns when it cannot, so CI fails here instead)."""
    if not native.loaded():
        pytest.skip(f"native extension not built: {native.describe()}")
    import numpy as np

    from tokenloom.blending import helpers

    di, dsi = helpers.blending_indices([0.25, 0.75], 8)
    sample = helpers.build_sample_idx(np.full(4, 5, np.int32), np.arange(4, dtype=np.int32), 4, 1, 20)
    assert f"{di.tolist()} {dsi.tolist()} {sample.tolist()}" == EXPECTED
    assert native.describe().startswith("loaded")
