"""The embedded default job behind ``tokenloom demo``: the whole product on any machine, no download.

Two corpora every Python install has: ``code`` (the standard library's sources, a module per
document) and ``docs`` (``help()``'s reference topics and every module's docstrings). It trains a
byte-level BPE tokenizer, preprocesses both (inspected, verified), builds a 60/40 blend, trains a
tiny GPT on 2 DDP ranks under torchrun, and ends with the validation loss, a sample and
``loss.png``, sized for a couple of minutes on 2 CPU cores.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenloom.blending.build import BuildConfig, build
from tokenloom.blending.plan import format_plan
from tokenloom.indexed import inspect, verify
from tokenloom.indexed.tools import format_report
from tokenloom.preprocess import PreprocessConfig
from tokenloom.preprocess import run as preprocess
from tokenloom.tokenizers import TrainTokenizerConfig, load_tokenizer, train_tokenizer
from tokenloom.train.config import TrainConfig
from tokenloom.train.data import BlendDataConfig, DataConfig
from tokenloom.train.generate import GenerateConfig, generate
from tokenloom.train.launch import launch
from tokenloom.train.metrics import read_metrics
from tokenloom.train.model.config import GPTConfig
from tokenloom.train.optim.adamw import OptimConfig

# Tests, vendored packages and the codec tables of encodings/ (hex dumps, not code anyone writes).
EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__",
                 "encodings"}


@dataclass(kw_only=True)
class DemoConfig:
    output_dir: str = "demo-out"
    """Directory for the corpora, tokenizer, token files, index cache and training run."""
    max_documents: int = 600
    """Stdlib modules to read (sorted by path, so one Python version always sees the same corpus)."""
    vocab_size: int = 4096
    """Vocabulary of the BPE tokenizer the demo trains."""
    train_iters: int = 400
    """Optimizer steps of the demo training run."""
    nproc: int = 2
    """Data-parallel ranks (processes started through torchrun)."""


def stdlib_files(max_documents: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)[:max_documents]


def stdlib_documents(max_documents: int) -> tuple[list[dict], list[dict]]:
    """(code, docs) records: module sources, and reference topics + module docstrings."""
    root = Path(sysconfig.get_paths()["stdlib"])
    code, docs = [], []
    for path in stdlib_files(max_documents):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        name = str(path.relative_to(root))
        code.append({"text": text, "path": name})
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        strings = [ast.get_docstring(node) for node in ast.walk(tree)
                   if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        prose = "\n\n".join(s for s in strings if s)
        if prose:
            docs.append({"text": prose, "path": name})
    try:
        import pydoc_data.topics  # lazy: optional module, some distributions strip pydoc_data

        topics: dict[str, str] = pydoc_data.topics.topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    docs.extend({"text": text, "path": f"pydoc:{key}"} for key, text in sorted(topics.items()))
    return code, docs


def write_corpus(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _train_config(cfg: DemoConfig, out: Path, tok, prefixes: list[tuple[float, str]]):
    return TrainConfig(
        model=GPTConfig(arch="gpt2", vocab_size=tok.vocab_size, seq_len=128, n_layers=4, n_heads=4, d_model=128),
        data=DataConfig(blend=BlendDataConfig(prefixes=prefixes, split="95,5,0", cache_dir=str(out / "cache"))),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_iters=min(30, max(1, cfg.train_iters // 10)), weight_decay=0.1),
        micro_batch_size=8, global_batch_size=16 * cfg.nproc, train_iters=cfg.train_iters,
        eval_interval=max(1, cfg.train_iters // 6), eval_iters=4, log_interval=max(1, cfg.train_iters // 6),
        save_interval=cfg.train_iters, output_dir=str(out / "run"), tokenizer=str(out / "tokenizer"),
        precision="fp32", progress=False, seed=1234)


def run(cfg: DemoConfig, echo=print) -> dict:
    out = Path(cfg.output_dir)
    code, docs = stdlib_documents(cfg.max_documents)
    corpora = {"code": write_corpus(out / "corpus" / "code.jsonl", code),
               "docs": write_corpus(out / "corpus" / "docs.jsonl", docs)}
    echo(f"== corpora (from this Python install): {len(code)} stdlib modules, {len(docs)} prose documents")

    tok_dir = train_tokenizer(TrainTokenizerConfig(inputs=[str(p) for p in corpora.values()],
                                                   output=str(out / "tokenizer"), kind="bpe",
                                                   vocab_size=cfg.vocab_size))
    tok = load_tokenizer(tok_dir)
    echo(f"== tokenizer: byte-level BPE, {tok.vocab_size} ids, eod={tok.eod} -> {tok_dir}")

    prefixes = {}
    for name, path in corpora.items():
        prefix = out / "tokens" / name
        echo(f"== preprocess {name}")
        preprocess(PreprocessConfig(inputs=[str(path)], output_prefix=str(prefix), tokenizer=str(tok_dir),
                                    append_eod=True, progress=False), echo=echo)
        checked = verify(prefix, vocab_size=tok.vocab_size, eod=tok.eod)
        echo(format_report({k: v for k, v in inspect(prefix).items() if k != "sequence_length"}))
        echo(f"verified {name}: {', '.join(checked['checked'])}")
        prefixes[name] = str(prefix)

    blend = [(0.6, prefixes["code"]), (0.4, prefixes["docs"])]
    train_cfg = _train_config(cfg, out, tok, blend)
    sizes = (train_cfg.train_iters * train_cfg.global_batch_size, train_cfg.eval_iters * train_cfg.global_batch_size,
             train_cfg.eval_iters * train_cfg.global_batch_size)
    build_cfg = BuildConfig(data=blend, split="95,5,0", seq_length=train_cfg.model.seq_len, num_samples=sizes,
                            seed=train_cfg.data.seed, cache_dir=str(out / "cache"))
    echo("== build: blend plan (the training run below reuses these cached indices)")
    echo(format_plan(build(build_cfg), build_cfg))

    echo(f"== train: GPT {train_cfg.model.n_layers} layers x {train_cfg.model.d_model}, {cfg.nproc} DDP ranks "
         f"(torchrun, gloo on CPU), {cfg.train_iters} steps")
    launch(train_cfg, nproc_per_node=cfg.nproc)
    metrics = read_metrics(Path(train_cfg.output_dir) / "metrics.jsonl")
    val = [(m["iter"], m["val_loss"]) for m in metrics if "val_loss" in m]
    echo("validation loss: " + "  ".join(f"{it}: {loss:.3f}" for it, loss in val))
    sample = generate(GenerateConfig(checkpoint=str(Path(train_cfg.output_dir) / "checkpoints"),
                      prompt="The ", max_new_tokens=80, temperature=0.8, top_k=40, seed=0))
    echo("== sample (prompt 'The '):\n" + sample)
    png = Path(train_cfg.output_dir) / "loss.png"
    echo(f"== loss curve: {png}")
    return {"val_loss": val, "sample": sample, "loss_png": str(png)}
