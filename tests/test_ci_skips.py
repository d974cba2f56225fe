"""Under CI=true a test that would skip for a missing required part fails, naming the part;
locally it skips with the reason. Shown with megatron-core made unimportable (a ``megatron``
package on PYTHONPATH whose import raises)."""

from __future__ import annotations

import os
import subprocess
import sys

from tl_testing import REPO, limit_s


def run_interop(tmp_path, ci: bool) -> subprocess.CompletedProcess:
    broken = tmp_path / "megatron"
    broken.mkdir(exist_ok=True)
    (broken / "__init__.py").write_text('raise ImportError("megatron broken on purpose")\n')
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/interop", "-k", "interop"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=limit_s(240))


def test_missing_megatron_fails_in_ci_and_skips_locally(tmp_path):
    ci = run_interop(tmp_path, ci=True)
    assert ci.returncode != 0 and "megatron-core not installed or not importable" in ci.stdout, ci.stdout[-2000:]
    assert "CI=true: this would have been skipped" in ci.stdout
    local = run_interop(tmp_path, ci=False)
    assert local.returncode in (0, 5), local.stdout[-2000:]  # 5: every collected module skipped
    assert "3 skipped" in local.stdout and "megatron-core not installed or not importable" in local.stdout
