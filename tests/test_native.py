"""The native extension is an accelerator: without it tokenloom works, with one clear warning."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tl_testing import REPO

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


def test_works_without_the_extension_with_one_warning():
    out = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSION], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    count_line, result_line = out.stdout.strip().splitlines()
    assert count_line.startswith("1 ") and "native extension unavailable" in count_line
    if native.loaded():  # the fallback gives the extension's answer
        import numpy as np

        from tokenloom.blending import helpers

        di, dsi = helpers.blending_indices([0.25, 0.75], 8)
        sample = helpers.build_sample_idx(np.full(4, 5, np.int32), np.arange(4, dtype=np.int32), 4, 1, 20)
        assert result_line == f"{di.tolist()} {dsi.tolist()} {sample.tolist()}"


def test_info_says_whether_the_extension_is_loaded():
    assert native.describe().startswith("loaded" if native.loaded() else "not loaded")
