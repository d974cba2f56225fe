"""Datasets on object storage: ``build``, ``train``, ``merge``, ``inspect`` and ``verify`` read
``s3://`` prefixes where they are and give exactly what they give from local copies (issue 41).

Three small prefixes (with manifests) are written locally and uploaded to moto's S3 server (the
``s3`` fixture); every command runs as a user runs it, in a subprocess with the endpoint and the
credentials in the standard AWS variables and its own node cache (``TOKENLOOM_CACHE``). Faults:
a proxy in front of the server drops about 5% of requests (:class:`tl_testing.FaultProxy`), and a
missing object, a wrong key and an unreachable endpoint each end in one line naming the URL.
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import numpy as np
import pytest
from tl_testing import FaultProxy, closed_port, one_line_error, run_cli

from tokenloom.indexed import IndexedDatasetWriter, manifest

pytest.importorskip("moto.moto_server.werkzeug_app", reason="needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")

NAMES = ("web", "code", "books")
TOKENIZER = {"kind": "byte", "files": {}, "vocab_size": 64, "eod": 0, "bos": None, "pad": None, "options": {},
             "digest": "test"}
TRAIN = ["--seq-length", "16", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--set", "model.vocab_size=64", "--set", "progress=false", "--set", "plot=false", "--eval-interval", "2",
         "--eval-iters", "1", "--split", "90,10,0", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "4", "--save-interval", "4", "--log-interval", "1", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def data(s3, tmp_path_factory):
    """The three prefixes locally and under s3://data/blend/; ``{"local": [...], "remote": [...]}``."""
    local = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(41)
    fs = s3.fs()
    fs.mkdir("data")
    out: dict = {"local": [], "remote": [], "dir": local}
    for i, name in enumerate(NAMES):
        prefix = local / name
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
            for _ in range(120 + 40 * i):
                writer.add_document(np.append(rng.integers(1, 64, int(rng.integers(4, 60))), 0))
            counts = {"documents": writer.num_documents, "sequences": writer.num_sequences,
                      "tokens": writer.num_tokens}
        manifest.write(prefix, manifest.build(str(prefix), "text", "uint16", [], TOKENIZER,
                                              {"append_eod": True}, counts))
        for suffix in (".bin", ".idx", ".manifest.json"):
            fs.put_file(f"{prefix}{suffix}", f"data/blend/{name}{suffix}")
        out["local"].append(str(prefix))
        out["remote"].append(f"s3://data/blend/{name}")
    return out


def _env(s3, tmp: Path, endpoint: str | None = None, key: str | None = None) -> dict[str, str]:
    env = s3.env(endpoint, **({"key": key} if key else {}))
    env.update(TOKENLOOM_CACHE=str(tmp / "node-cache"), AWS_MAX_ATTEMPTS="1")
    return env


def _blend(prefixes: list[str]) -> list[str]:
    return [x for i, p in enumerate(prefixes) for x in (str(0.2 + 0.3 * i), p)]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.suffix == ".npy"}


def test_build_from_s3_gives_the_local_arrays_and_reuses_the_local_cache(s3, data, tmp_path):
    """Same index arrays, under the same content keys: a remote build (here from a blend file) in the
    cache the local build filled builds nothing."""
    args = ["build", "--seq-length", "16", "--num-samples", "300,20,10", "--split", "90,8,2"]
    local = run_cli(*args, "--cache-dir", tmp_path / "local", "--data", *_blend(data["local"]))
    assert local.returncode == 0, local.stderr
    remote = run_cli(*args, "--cache-dir", tmp_path / "remote", "--data", *_blend(data["remote"]),
                     env=_env(s3, tmp_path))
    assert remote.returncode == 0, remote.stderr
    built = _tree(tmp_path / "local")
    assert built and _tree(tmp_path / "remote") == built
    blend_file = tmp_path / "blend.json"  # a blend file names object-store prefixes as --data does
    weights = _blend(data["remote"])[::2]
    blend_file.write_text(json.dumps({"data": [[float(w), p] for w, p in zip(weights, data["remote"], strict=True)]}))
    again = run_cli(*args, "--cache-dir", tmp_path / "local", "--blend-file", blend_file, env=_env(s3, tmp_path))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == \
        sorted(p.name for p in (tmp_path / "remote").iterdir()), "the remote copy hits the local entries"
    assert "(0 built, 3 loaded)" in again.stdout and "(3 built, 0 loaded)" in local.stdout, again.stdout
    keys = [line.split()[-1] for line in local.stdout.splitlines() if line.startswith("train ")]
    assert keys and keys == [line.split()[-1] for line in again.stdout.splitlines() if line.startswith("train ")]


def test_merge_to_s3_gives_the_local_bytes_and_inspect_verify_print_the_same(s3, data, tmp_path):
    env = _env(s3, tmp_path)
    done = run_cli("merge", "--output-prefix", tmp_path / "merged", *data["local"])
    assert done.returncode == 0, done.stderr
    done = run_cli("merge", "--output-prefix", "s3://data/out/merged", *data["remote"], env=env)
    assert done.returncode == 0, done.stderr
    fs = s3.fs()
    for suffix in (".bin", ".idx", ".manifest.json"):
        assert fs.cat_file(f"data/out/merged{suffix}") == (tmp_path / f"merged{suffix}").read_bytes(), suffix
    for command in (["inspect"], ["verify"]):
        here = run_cli(*command, tmp_path / "merged")
        there = run_cli(*command, "s3://data/out/merged", env=env)
        assert here.returncode == there.returncode == 0, there.stderr
        assert there.stdout == here.stdout.replace(str(tmp_path / "merged"), "s3://data/out/merged")


def _losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["iter"]: r[key] for r in records for key in ("train_loss", "val_loss") if key in r}


def _train(out: Path, prefixes: list[str], env=None):
    return run_cli("train", *TRAIN, "--output-dir", out, "--cache-dir", out.parent / f"{out.name}-cache",
                   "--data", *_blend(prefixes), env=env, timeout=300)


def _same_run(a: Path, b: Path) -> None:
    losses = _losses(a)
    assert losses and _losses(b).keys() == losses.keys()
    assert all(abs(_losses(b)[k] - v) <= 1e-6 for k, v in losses.items())
    ckpt_a, ckpt_b = a / "checkpoints", b / "checkpoints"
    tensors = [p.relative_to(ckpt_a) for p in ckpt_a.rglob("*.pt")]
    assert tensors
    for rel in tensors:
        assert filecmp.cmp(ckpt_a / rel, ckpt_b / rel, shallow=False), rel


@pytest.fixture(scope="module")
def local_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "local"
    done = _train(out, data["local"])
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_train_dp2_from_s3_gives_the_local_losses_and_checkpoints(s3, data, local_run, tmp_path):
    done = _train(tmp_path / "remote", data["remote"], env=_env(s3, tmp_path))
    assert done.returncode == 0, done.stderr
    _same_run(local_run, tmp_path / "remote")


@pytest.mark.slow
def test_train_through_an_endpoint_dropping_5_percent_of_requests_gives_the_same_losses(s3, data, local_run,
                                                                                        tmp_path):
    proxy = FaultProxy(s3.endpoint, drop=0.05, seed=41)
    try:
        env = _env(s3, tmp_path, proxy.endpoint)
        env["AWS_MAX_ATTEMPTS"] = "1"  # botocore does not retry: what is retried, tokenloom retries
        done = _train(tmp_path / "faulty", data["remote"], env=env)
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr
    assert proxy.dropped, f"no request of {proxy.requests} was dropped: the test tested nothing"
    _same_run(local_run, tmp_path / "faulty")


def test_a_missing_object_ends_train_in_one_line_naming_the_url_before_any_rank_starts(s3, data, tmp_path):
    prefixes = [*data["remote"][:2], "s3://data/blend/nothing"]
    done = _train(tmp_path / "run", prefixes, env=_env(s3, tmp_path))
    one_line_error(done, "s3://data/blend/nothing.idx", "no such object")
    assert not (tmp_path / "run").exists(), "no rank started"


@pytest.mark.parametrize("case", ["wrong key", "unreachable"])
def test_a_wrong_key_or_an_unreachable_endpoint_is_one_line_naming_the_url(s3, data, tmp_path, case):
    if case == "wrong key":
        env, fragment = _env(s3, tmp_path, key="wrong"), "access denied (check AWS_ACCESS_KEY_ID"
    else:
        env, fragment = _env(s3, tmp_path, f"http://127.0.0.1:{closed_port()}"), "cannot reach the object store"
    for command in ("verify", "inspect")[: 2 if case == "wrong key" else 1]:  # unreachable: retried for seconds
        one_line_error(run_cli(command, data["remote"][0], env=env), data["remote"][0], fragment)
    done = _train(tmp_path / "run", [data["remote"][0]], env=env)  # train: in its checks, before any rank
    one_line_error(done, data["remote"][0], fragment)
    assert not (tmp_path / "run").exists(), "no rank started"
