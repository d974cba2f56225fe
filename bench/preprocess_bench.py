"""preprocess throughput and memory: tokenloom vs a Megatron-style baseline vs the tokenizer ceiling.

All rows are measured in one run on the same cores:

* tokenloom      ``python cli.py preprocess`` end to end (jsonl in, .bin/.idx/manifest out), all cores.
* megatron-style what ``tools/preprocess_data.py`` does: ``multiprocessing.Pool(W).imap(encode, lines,
                 chunksize=32)``, one document per task, ids returned as Python lists, written by
                 megatron-core's ``IndexedDatasetBuilder``. Tokenizer: Megatron's GPT2BPETokenizer
                 algorithm (pure Python, see _python_bpe.py); a second row uses the fast HF tokenizer
                 in the same structure.
* ceiling        the reference backend's own batch API on the same texts already in memory, all cores
                 (for GPT-2 files: tiktoken's ``encode_ordinary_batch(texts, num_threads=cores)``,
                 ids left as tiktoken returns them).
* gigatoken      the ceiling of issue 21: gigatoken's own ``encode_files`` on the same jsonl (it reads
                 and tokenizes), all cores, nothing written, in a fresh process each round as tokenloom
                 runs (a tokenizer object kept across rounds keeps its word cache warm: 3x faster from
                 the second round on). tokenloom's ``auto`` backend runs gigatoken for these files after
                 its self-check, whose verdict is cached per user after the first run (a warm-up run of
                 each tokenizer before timing). GPT-2 and the NeoX-20B tokenizer.json.
* --large-mb N   the same two rows on the novels repeated to N MB (>= 500: start-up is not what is
                 measured), with peak memory there against the default corpus, and the scaling from
                 ``--workers 1`` (tokenized in the main process) to all cores, with the serial fraction
                 that Amdahl's law gives for it (the input hasher is a process of its own in both runs).
* encode only    for information: the texts in memory split into one slice per core, each
                 encoded by its own forked process (``encode_to_numpy``, as tokenloom's workers
                 do), no JSON, no I/O, no start-up. tiktoken's batch API is bound by building
                 Python ints under the GIL; processes are not, so this is the higher bound.

Timed rows alternate in rounds (``--repeat``, best round each), without the memory sampler.
Peak memory is the proportional set size (PSS) summed over tokenloom's process tree (main +
workers), sampled every 20 ms, for the corpus and for 2x and 4x the corpus. Sampled over
time it rises by ~15 MB during the first ~3 s of a run and is flat after that (warm-up, not
per-document growth), so 1x (a ~2 s run) sits a little below 2x and 4x. PSS, not RSS: forked
workers share the parent's pages copy-on-write, and a sum of RSS would count those pages once
per process. Outputs are checked byte-identical across rows.

* distinct words issue 39's corpus: random lowercase words, nearly all distinct (URLs, numbers,
                 hashes and code behave alike), ``--distinct-mb`` MB and 4x that, 2 workers, GPT-2 on each
                 backend ``auto`` can pick for it (gigatoken, and the tiktoken reference). gigatoken caches
                 every distinct word; ``--encoder-memory-mb`` (default) bounds what that adds to a worker,
                 so peak memory must not grow with the corpus (target 4x/1x <= 1.1). The 1x corpus must
                 be large enough for each worker to reach the bound. ``--distinct-only`` runs these rows
                 alone; ``--distinct-mb 0`` skips them.

* dedup          issue 56: ``--dedup minhash`` (and ``exact``, for information) against the plain run on
                 the default corpus, alternating, best round each (target <= 2.0), and its peak memory
                 on 4x the corpus against 1x (target <= 1.1; the 4x corpus repeats the novels, so three
                 quarters of it are duplicates, which the run files, the bucket pass and the removed list
                 all carry). ``--dedup-only`` runs these rows alone.

* stdlib         issue 56's acceptance 5: plain ``preprocess`` (no dedup, no filters) against gigatoken's own
                 single-pass ``encode_files`` (GPT-2, and NeoX-20B's tokenizer.json) on the standard library's
                 sources and pydoc topics, whole copies to ``--stdlib-mb`` MB (528: 16 copies), ``--workers``
                 processes against as many gigatoken threads, fresh processes, alternating, best round each
                 (target <= 1.2); peak memory there against a quarter of the copies (flat: the bound holds).
                 ``--stdlib-only`` runs these rows alone; ``--stdlib-mb 0`` skips them.

Usage: python bench/preprocess_bench.py [--documents N] [--doc-bytes B] [--distinct-mb MB] [--distinct-only]
                                         [--dedup-only] [--stdlib-mb MB] [--stdlib-only]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from _python_bpe import PythonGPT2BPE  # noqa: E402
from _table import best_interleaved, print_table, timed  # noqa: E402

SHARED = Path(os.environ.get("TOKENLOOM_SHARED_DATA", REPO.parent / "shared" / "data"))
GPT2 = SHARED / "tokenizers" / "gpt2"
NEOX = SHARED / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"
GIGATOKEN = """
import sys, gigatoken
kind, path, corpus = sys.argv[1:]  # threads: RAYON_NUM_THREADS (set by the caller), else every core
tok = (gigatoken.Tokenizer.from_tiktoken(path, pretokenizer="gpt2", special_tokens={}) if kind == "tiktoken"
       else gigatoken.Tokenizer.from_json(open(path, "rb").read()))
tok.encode_files(gigatoken.JsonlFileSource([corpus], field="text"), parallel=True)
"""


def novel_documents(doc_bytes: int) -> list[str]:
    """The shared novels cut into ~doc_bytes documents at line boundaries (README advice)."""
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(open(SHARED / "english-novels" / "english_novels.jsonl.zst",
                                                          "rb"), read_across_frames=True)
    docs = []
    for line in io.TextIOWrapper(raw, encoding="utf-8"):
        cur, size = [], 0
        for text_line in json.loads(line)["text"].splitlines(keepends=True):
            cur.append(text_line)
            size += len(text_line)
            if size >= doc_bytes:
                docs.append("".join(cur))
                cur, size = [], 0
        if cur:
            docs.append("".join(cur))
    return docs


def write_corpus(path: Path, texts: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return path


def distinct_words_corpus(path: Path, megabytes: float, seed: int = 0, doc_bytes: int = 4000) -> Path:
    """A jsonl of random lowercase words (2 to 11 letters): nearly every word is new to a word cache."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    with open(path, "w", encoding="utf-8") as f:
        while f.tell() < megabytes * 1e6:
            chars = letters[rng.integers(0, 26, doc_bytes)]
            spaces = rng.integers(3, 13, doc_bytes // 3).cumsum()
            chars[spaces[spaces < doc_bytes]] = ord(" ")
            f.write(json.dumps({"text": chars.tobytes().decode()}) + "\n")
    return path


def distinct_rows(args, tmp: Path) -> None:
    """Issue 39's acceptance 1: peak memory of 4x a corpus of distinct words against 1x, per backend."""
    small = distinct_words_corpus(tmp / "distinct1.jsonl", args.distinct_mb)
    large = distinct_words_corpus(tmp / "distinct4.jsonl", 4 * args.distinct_mb, seed=1)
    workers = 2

    def cmd(src, prefix, backend):
        return [sys.executable, str(REPO / "cli.py"), "preprocess", "--input", str(src), "--output-prefix",
                str(tmp / prefix), "--tokenizer", str(GPT2 / "gpt2.tiktoken"), "--tokenizer-backend", backend,
                "--append-eod", "--workers", str(workers), "--no-progress"]

    rows = []
    for backend in ("gigatoken", "reference"):
        t1, rss1 = run_measured(cmd(small, f"d1-{backend}", backend))
        t4, rss4 = run_measured(cmd(large, f"d4-{backend}", backend))
        rows.append((f"distinct words, {backend}: peak PSS 4x vs 1x (target <= 1.1)", f"{rss4 / 2**20:.0f} MB",
                     f"{rss1 / 2**20:.0f} MB", f"{rss4 / rss1:.2f}x"))
        rows.append((f"distinct words, {backend}: seconds 4x vs 1x (linear = 4.0)", f"{t4:.1f} s", f"{t1:.1f} s",
                     f"{t4 / t1:.2f}x"))
    for ext in (".bin", ".idx"):
        for size in ("d1", "d4"):
            if (tmp / f"{size}-gigatoken{ext}").read_bytes() != (tmp / f"{size}-reference{ext}").read_bytes():
                raise SystemExit(f"outputs differ: {size}-gigatoken{ext} vs {size}-reference{ext}")
    print_table(f"preprocess on distinct words: {small.stat().st_size / 1e6:.0f} MB and "
                f"{large.stat().st_size / 1e6:.0f} MB jsonl, GPT-2 rank file, {workers} workers on "
                f"{os.cpu_count()} cores, default --encoder-memory-mb, one run each, memory sampled "
                "(outputs byte-identical across backends)", rows)


def stdlib_copy() -> bytes:
    """Issue 56's corpus, one copy: every module of this Python's standard library (its ``.py`` sources, one
    module per document; ``site-packages`` left out) and pydoc's reference topics, as jsonl. Code: many
    distinct words (identifiers, strings, numbers) where the novels repeat a small vocabulary."""
    import pydoc_data.topics

    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                text = (Path(dirpath) / name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            lines.append(json.dumps({"text": text}, ensure_ascii=False))
    lines += [json.dumps({"text": text}, ensure_ascii=False) for _, text in sorted(pydoc_data.topics.topics.items())]
    return ("\n".join(lines) + "\n").encode()


def write_copies(path: Path, one: bytes, megabytes: float) -> int:
    """``one`` written whole as many times as comes nearest ``megabytes`` (at least once); the copies."""
    copies = max(1, round(megabytes * 1e6 / len(one)))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(one)
    return copies


def stdlib_rows(args, tmp: Path) -> None:
    """Issue 56's acceptance 5: plain ``preprocess`` (no dedup, no filters) against gigatoken's own single-pass
    ``encode_files`` on the same jsonl, GPT-2 and NeoX-20B, both in fresh processes on the same number of
    cores (``--workers`` processes; ``RAYON_NUM_THREADS`` threads), alternating, best round each; and
    preprocess's peak memory there against a quarter of the copies (the encoder's memory bound holds)."""
    w, one = args.workers, stdlib_copy()
    corpus, quarter, head = tmp / "stdlib.jsonl", tmp / "stdlib-quarter.jsonl", tmp / "stdlib-head.jsonl"
    copies = write_copies(corpus, one, args.stdlib_mb)
    fewer = write_copies(quarter, one, args.stdlib_mb / 4)
    head.write_bytes(b"".join(one.splitlines(keepends=True)[:50]))
    runs = iter(range(1_000_000))

    def cmd(src: Path, prefix: Path, tokenizer: Path) -> list[str]:
        return [sys.executable, str(REPO / "cli.py"), "preprocess", "--input", str(src), "--output-prefix",
                str(prefix), "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(w), "--no-progress"]

    def ours(tokenizer: Path) -> None:
        prefix = tmp / f"std{next(runs)}"
        subprocess.run(cmd(corpus, prefix, tokenizer), check=True, stdout=subprocess.DEVNULL)
        remove_outputs(prefix)

    def giga(tokenizer: Path) -> None:
        kind, path = ("tiktoken", GPT2 / "gpt2.tiktoken") if tokenizer == GPT2 else ("json", tokenizer)
        subprocess.run([sys.executable, "-c", GIGATOKEN, kind, str(path), str(corpus)], check=True,
                       env={**os.environ, "RAYON_NUM_THREADS": str(w)})

    for tokenizer in (GPT2, NEOX):  # the self-check's verdict cached, as on every run after a user's first
        subprocess.run(cmd(head, tmp / "std-warm", tokenizer), check=True, stdout=subprocess.DEVNULL)
        remove_outputs(tmp / "std-warm")
    t_ours, t_giga, t_ours_neox, t_giga_neox = best_interleaved([
        timed(ours, GPT2), timed(giga, GPT2), timed(ours, NEOX), timed(giga, NEOX)], repeat=args.repeat)
    _, rss = run_measured(cmd(corpus, tmp / "std-mem", GPT2))
    _, rss_quarter = run_measured(cmd(quarter, tmp / "std-mem-quarter", GPT2))
    mb = corpus.stat().st_size / 1e6
    rows = [
        ("plain preprocess vs gigatoken encode_files, GPT-2 (target <= 1.2)", f"{t_ours:.2f} s", f"{t_giga:.2f} s",
         f"{t_ours / t_giga:.2f}x"),
        ("plain preprocess vs gigatoken encode_files, NeoX-20B tokenizer.json", f"{t_ours_neox:.2f} s",
         f"{t_giga_neox:.2f} s", f"{t_ours_neox / t_giga_neox:.2f}x"),
        (f"peak memory (PSS), GPT-2, {copies} copies vs {fewer} (flat = 1.0)", f"{rss / 2**20:.0f} MB",
         f"{rss_quarter / 2**20:.0f} MB", f"{rss / rss_quarter:.2f}x"),
    ]
    print_table(f"plain preprocess vs gigatoken encode_files (issue 56): {mb:.0f} MB jsonl (the standard library's "
                f"sources and pydoc topics, {copies} copies), {w} workers / {w} gigatoken threads on {os.cpu_count()} "
                f"cores, fresh processes, best of {args.repeat} alternating rounds (time: lower is better); "
                "memory sampled in one run each", rows)
    for path in (corpus, quarter, head):
        path.unlink()
    for prefix in ("std-mem", "std-mem-quarter"):
        remove_outputs(tmp / prefix)


# --------------------------------------------------------------------------- peak RSS of a process tree


def _tree_pss(root: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        try:  # PSS: pages shared copy-on-write by forked workers are counted once, not per process
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
        stack.extend(children.get(pid, []))
    return total


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak PSS of a command's process tree."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_pss(proc.pid))
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"command failed: {' '.join(cmd)}\n{proc.stderr.read().decode()}")
    return elapsed, peak


# --------------------------------------------------------------------------- Megatron-style baseline

_ENCODER = None


def _init_python_bpe():
    global _ENCODER
    _ENCODER = PythonGPT2BPE(str(GPT2 / "gpt2-vocab.json"), str(GPT2 / "gpt2-merges.txt"))


def _init_hf():
    global _ENCODER
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(GPT2 / "gpt2-vocab.json"), str(GPT2 / "gpt2-merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    class _Enc:
        eod = 50256

        def encode(self, text):
            return tok.encode(text, add_special_tokens=False).ids

    _ENCODER = _Enc()


_TEXTS: list[str] = []


def _encode_slice(bounds: tuple[int, int]) -> int:
    return sum(len(_ENCODER.encode_to_numpy(t, disallowed_special=())) for t in _TEXTS[bounds[0]:bounds[1]])


def encode_only(enc, texts: list[str], workers: int) -> float:
    """Seconds for one forked process per core to encode its slice of ``texts`` (no I/O)."""
    global _ENCODER, _TEXTS
    _ENCODER, _TEXTS = enc, texts
    cuts = np.linspace(0, len(texts), workers + 1).astype(int)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(_encode_slice, [(0, 0)] * workers)  # processes up
        start = time.perf_counter()
        pool.map(_encode_slice, list(zip(cuts[:-1], cuts[1:], strict=True)), chunksize=1)
        return time.perf_counter() - start


def _encode_line(line: str):
    ids = _ENCODER.encode(json.loads(line)["text"])
    if ids:
        ids.append(50256)
    return ids, len(line)


def megatron_style(corpus: Path, prefix: Path, workers: int, init) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    with open(corpus, encoding="utf-8") as fin, multiprocessing.get_context("fork").Pool(workers, init) as pool:
        for ids, _ in pool.imap(_encode_line, fin, 32):
            builder.add_document(np.array(ids, dtype=np.int64), [len(ids)] if ids else [])
    builder.finalize(f"{prefix}.idx")
    return time.perf_counter() - start


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=12_000)
    ap.add_argument("--doc-bytes", type=int, default=4000, help="~4 KB documents, as the data README suggests")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each row is its best round")
    ap.add_argument("--large-mb", type=int, default=520,
                    help="the gigatoken rows also on a corpus of about this size (0: not)")
    ap.add_argument("--distinct-mb", type=float, default=75,
                    help="the distinct-words memory rows on a corpus of this size and 4x it (0: not)")
    ap.add_argument("--distinct-only", action="store_true", help="run the distinct-words rows alone")
    ap.add_argument("--dedup-only", action="store_true", help="run the --dedup rows alone")
    ap.add_argument("--stdlib-mb", type=float, default=528,
                    help="plain preprocess vs gigatoken encode_files on the standard library corpus of about this "
                         "size, in whole copies (0: not)")
    ap.add_argument("--stdlib-only", action="store_true", help="run the standard-library rows alone")
    args = ap.parse_args()
    if not (GPT2 / "gpt2-vocab.json").exists():
        raise SystemExit(f"needs the shared GPT-2 files under {GPT2} (set TOKENLOOM_SHARED_DATA)")
    if args.distinct_only:
        distinct_rows(args, Path(tempfile.mkdtemp(prefix="tl-pp-bench-")))
        return
    if args.stdlib_only:
        tmp = Path(tempfile.mkdtemp(prefix="tl-pp-bench-"))
        try:
            stdlib_rows(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    sys.path.insert(0, str(REPO))
    from tokenloom.tokenizers import load_tokenizer

    docs = novel_documents(args.doc_bytes)
    if len(docs) < 4 * args.documents:
        docs = docs * (4 * args.documents // len(docs) + 1)
    texts = docs[: args.documents]
    tmp = Path(tempfile.mkdtemp(prefix="tl-pp-bench-"))
    corpus = write_corpus(tmp / "corpus.jsonl", texts)
    corpus2 = write_corpus(tmp / "corpus2.jsonl", docs[: 2 * args.documents])
    corpus4 = write_corpus(tmp / "corpus4.jsonl", docs[: 4 * args.documents])
    mb = corpus.stat().st_size / 1e6
    w = args.workers

    def tokenloom_cmd(src, prefix, tokenizer=GPT2, workers=w):
        return [sys.executable, str(REPO / "cli.py"), "preprocess", "--input", str(src), "--output-prefix",
                str(prefix), "--tokenizer", str(tokenizer), "--append-eod", "--workers", str(workers), "--no-progress"]

    tok = load_tokenizer(str(GPT2), num_threads=w, backend="reference")
    if tok.engine != "tiktoken":
        raise SystemExit(f"expected the tiktoken engine for {GPT2}, got {tok.engine}")
    tok.enc.encode_ordinary_batch(texts[:20], num_threads=w)  # warm

    def ceiling():  # the backend tokenloom picked for these files, texts in memory, all cores
        tok.enc.encode_ordinary_batch(texts, num_threads=w)

    def giga_ceiling(src, tokenizer=GPT2):  # reads the jsonl itself, all cores, a fresh process
        kind, path = ("tiktoken", GPT2 / "gpt2.tiktoken") if tokenizer == GPT2 else ("json", tokenizer)
        subprocess.run([sys.executable, "-c", GIGATOKEN, kind, str(path), str(src)], check=True)

    runs = iter(range(1_000_000))

    def ours(src=corpus, tokenizer=GPT2, keep="ours0", workers=w):
        """A new prefix each round (an existing output would be a finished run); only ``keep`` stays."""
        prefix = tmp / f"ours{next(runs)}"
        subprocess.run(tokenloom_cmd(src, prefix, tokenizer, workers), check=True, stdout=subprocess.DEVNULL)
        if prefix.name != keep:
            remove_outputs(prefix)

    head = write_corpus(tmp / "head.jsonl", texts[:50])
    for tokenizer in (GPT2, NEOX):  # the self-check's verdict cached, as on every run after a user's first
        subprocess.run(tokenloom_cmd(head, tmp / "warm", tokenizer), check=True, stdout=subprocess.DEVNULL)
        remove_outputs(tmp / "warm")
    if args.dedup_only:
        dedup_rows(args, tmp, corpus, corpus4, mb, w, tokenloom_cmd)
        return

    # Timed runs alternate (the machine's load drifts; best of N each) and run without the
    # memory sampler, whose /proc walks would take CPU from the run being timed.
    t_ours, t_ceiling, t_giga, t_ours_neox, t_giga_neox, t_encode_only, t_hf, t_py = best_interleaved([
        timed(ours), timed(ceiling), timed(giga_ceiling, corpus), timed(ours, corpus, NEOX, ""),
        timed(giga_ceiling, corpus, NEOX), lambda: encode_only(tok.enc, texts, w),
        lambda: megatron_style(corpus, tmp / "mhf", w, _init_hf),
        lambda: megatron_style(corpus, tmp / "mpy", w, _init_python_bpe),
    ], repeat=args.repeat)
    _, rss1 = run_measured(tokenloom_cmd(corpus, tmp / "mem1"))
    _, rss2 = run_measured(tokenloom_cmd(corpus2, tmp / "mem2"))
    _, rss4 = run_measured(tokenloom_cmd(corpus4, tmp / "mem4"))
    for other in ("mhf", "mpy", "mem1"):
        for ext in (".bin", ".idx"):
            if (tmp / f"ours0{ext}").read_bytes() != (tmp / f"{other}{ext}").read_bytes():
                raise SystemExit(f"outputs differ: ours0{ext} vs {other}{ext}")
    from tokenloom.indexed import IndexedDataset

    tokens = int(IndexedDataset(str(tmp / "ours0")).sequence_lengths.sum(dtype=np.int64))  # eod included

    def tps(t):
        return f"{tokens / t / 1e6:.2f} M tok/s"

    rows = [
        ("tokenloom vs ceiling (target >= 0.9)", tps(t_ours), tps(t_ceiling), f"{t_ceiling / t_ours:.2f}x"),
        ("tokenloom vs gigatoken encode_files, GPT-2", tps(t_ours), tps(t_giga), f"{t_giga / t_ours:.2f}x"),
        ("tokenloom vs gigatoken encode_files, NeoX-20B tokenizer.json", f"{t_ours_neox:.2f} s", f"{t_giga_neox:.2f} s",
         f"{t_giga_neox / t_ours_neox:.2f}x"),
        ("for information: tokenloom vs encode only, 1 process per core", tps(t_ours), tps(t_encode_only),
         f"{t_encode_only / t_ours:.2f}x"),
        ("tokenloom vs megatron-style, GPT2BPETokenizer (target >= 5)", tps(t_ours), tps(t_py),
         f"{t_py / t_ours:.2f}x"),
        ("tokenloom vs megatron-style, HF fast tokenizer", tps(t_ours), tps(t_hf), f"{t_hf / t_ours:.2f}x"),
        ("peak memory (PSS), corpus (target <= 300 MB)", f"{rss1 / 2**20:.0f} MB", "300 MB", f"{rss1 / (300 * 2**20):.2f}x"),
        ("peak memory (PSS), 4x corpus vs 1x (flat = 1.0)", f"{rss4 / 2**20:.0f} MB", f"{rss1 / 2**20:.0f} MB",
         f"{rss4 / rss1:.2f}x"),
        ("peak memory (PSS), 4x corpus vs 2x (flat = 1.0)", f"{rss4 / 2**20:.0f} MB", f"{rss2 / 2**20:.0f} MB",
         f"{rss4 / rss2:.2f}x"),
    ]
    print_table(f"preprocess: {len(texts)} documents, {mb:.1f} MB jsonl, {tokens / 1e6:.2f} M GPT-2 tokens, "
                f"{w} workers on {os.cpu_count()} cores, best of {args.repeat} alternating rounds "
                "(outputs byte-identical across rows)", rows)
    dedup_rows(args, tmp, corpus, corpus4, mb, w, tokenloom_cmd)
    if args.large_mb:
        large_rows(args, docs, tmp, w, rss1, ours, giga_ceiling, tokenloom_cmd)
    if args.distinct_mb:
        distinct_rows(args, tmp)
    if args.stdlib_mb:
        stdlib_rows(args, tmp)


def dedup_rows(args, tmp: Path, corpus: Path, corpus4: Path, mb: float, w: int, tokenloom_cmd) -> None:
    """``--dedup minhash`` / ``exact`` against the plain run (the same command otherwise), and dedup's
    peak memory on 4x the corpus against 1x."""
    runs = iter(range(1_000_000))

    def run(*options: str, src: Path = corpus) -> None:
        prefix = tmp / f"dd{next(runs)}"
        subprocess.run(tokenloom_cmd(src, prefix) + list(options), check=True, stdout=subprocess.DEVNULL)
        remove_outputs(prefix)
        Path(f"{prefix}.removed.jsonl").unlink(missing_ok=True)

    t_plain, t_minhash, t_exact = best_interleaved([timed(run), timed(run, "--dedup", "minhash"),
                                                    timed(run, "--dedup", "exact")], repeat=args.repeat)
    _, rss1 = run_measured(tokenloom_cmd(corpus, tmp / "ddmem1") + ["--dedup", "minhash"])
    _, rss4 = run_measured(tokenloom_cmd(corpus4, tmp / "ddmem4") + ["--dedup", "minhash"])
    removed = sum(1 for _ in open(tmp / "ddmem4.removed.jsonl", encoding="utf-8"))
    rows = [
        ("--dedup minhash vs plain preprocess, time (target <= 2.0)", f"{t_minhash:.2f} s", f"{t_plain:.2f} s",
         f"{t_minhash / t_plain:.2f}x"),
        ("for information: --dedup exact vs plain preprocess, time", f"{t_exact:.2f} s", f"{t_plain:.2f} s",
         f"{t_exact / t_plain:.2f}x"),
        (f"--dedup minhash peak memory (PSS), 4x corpus ({removed} removed) vs 1x (target <= 1.1)",
         f"{rss4 / 2**20:.0f} MB", f"{rss1 / 2**20:.0f} MB", f"{rss4 / rss1:.2f}x"),
    ]
    print_table(f"preprocess --dedup (issue 56): the {mb:.1f} MB corpus, GPT-2, {w} workers on {os.cpu_count()} cores, "
                f"best of {args.repeat} alternating rounds; memory sampled in one run each", rows)


def remove_outputs(prefix: Path) -> None:
    for ext in (".bin", ".idx", ".manifest.json"):
        Path(f"{prefix}{ext}").unlink()


def large_rows(args, docs, tmp, w, rss_small, ours, giga_ceiling, tokenloom_cmd) -> None:
    """Issue 21's acceptance 1: the gigatoken rows on a corpus of ``--large-mb``, and memory there."""
    from tokenloom.indexed import IndexedDataset

    large = tmp / "large.jsonl"
    with open(large, "w", encoding="utf-8") as f:
        while f.tell() < args.large_mb * 1e6:
            for t in docs:
                f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    mb = large.stat().st_size / 1e6
    t_gpt2, t_giga, t_neox, t_giga_neox, t_one = best_interleaved([
        timed(ours, large, GPT2, ""), timed(giga_ceiling, large), timed(ours, large, NEOX, ""),
        timed(giga_ceiling, large, NEOX), timed(ours, large, GPT2, "", 1)], repeat=args.repeat)
    speedup = t_one / t_gpt2
    serial = (w / speedup - 1) / (w - 1) if w > 1 else 1.0  # Amdahl: speedup = 1 / (f + (1 - f) / w)
    _, rss_large = run_measured(tokenloom_cmd(large, tmp / "memL"))
    tokens = int(IndexedDataset(str(tmp / "memL")).sequence_lengths.sum(dtype=np.int64))

    def tps(t):
        return f"{tokens / t / 1e6:.2f} M tok/s"

    rows = [
        ("tokenloom vs gigatoken encode_files, GPT-2 (target >= 0.8)", tps(t_gpt2), tps(t_giga),
         f"{t_giga / t_gpt2:.2f}x"),
        ("tokenloom vs gigatoken encode_files, NeoX-20B tokenizer.json (target >= 0.8)", f"{t_neox:.2f} s",
         f"{t_giga_neox:.2f} s", f"{t_giga_neox / t_neox:.2f}x"),
        (f"peak memory (PSS), {mb:.0f} MB corpus vs default corpus (flat = 1.0)", f"{rss_large / 2**20:.0f} MB",
         f"{rss_small / 2**20:.0f} MB", f"{rss_large / rss_small:.2f}x"),
        (f"scaling: {w} workers vs 1 (in-process), GPT-2; Amdahl serial fraction {serial:.2f}", f"{t_gpt2:.2f} s",
         f"{t_one:.2f} s", f"{speedup:.2f}x"),
    ]
    print_table(f"preprocess at scale: {mb:.0f} MB jsonl (the novels repeated), {tokens / 1e6:.1f} M GPT-2 tokens, "
                f"{w} workers on {os.cpu_count()} cores, best of {args.repeat} alternating rounds; gigatoken in a "
                "fresh process each round, as tokenloom", rows)


if __name__ == "__main__":
    main()
