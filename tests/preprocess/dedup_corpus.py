"""A dedup test corpus: real paragraphs of the shared English novels with planted exact copies and
near-duplicates (a few percent of words changed, or the end cut off; Jaccard of word 5-gram
shingles >= 0.85 to the original, measured here independently of tokenloom's code), each placed
after its original. A uniquely named helper module (not conftest) for test_dedup and test_ray."""

from __future__ import annotations

import io
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard
from tl_testing import shared_data_dir

NOVELS = shared_data_dir() / "english-novels" / "english_novels.jsonl.zst"


def novel_paragraphs(n: int, min_words: int = 30) -> list[str]:
    """The first ``n`` lines of the novels with at least ``min_words`` words, each text once."""
    seen, out = set(), []
    with open(NOVELS, "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            for para in json.loads(line)["text"].split("\n"):
                form = " ".join(unicodedata.normalize("NFC", para).split())
                if len(form.split()) >= min_words and form not in seen:
                    seen.add(form)
                    out.append(para)
                    if len(out) == n:
                        return out
    return out


def shingles(text: str, n: int = 5) -> set:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: str, b: str) -> float:
    x, y = shingles(a), shingles(b)
    return len(x & y) / max(len(x | y), 1)


@dataclass
class Corpus:
    texts: list[str]
    exact: dict[int, int]  # index of a planted exact copy -> index of its original
    near: dict[int, int]  # index of a planted near-duplicate -> index of its original

    def write(self, directory: Path, parts: int = 1) -> list[Path]:
        """The texts as ``parts`` jsonl files in order (one record a line: record n is line n)."""
        cuts = np.linspace(0, len(self.texts), parts + 1).astype(int)
        paths = []
        for k in range(parts):
            path = directory / f"dedup{k}.jsonl"
            path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                    for t in self.texts[cuts[k]:cuts[k + 1]]), encoding="utf-8")
            paths.append(path)
        return paths

    def index(self, paths: list[Path], input_path: str, record: int) -> int:
        """The text index of ``record`` of ``input_path`` (as removed.jsonl names it)."""
        sizes = np.linspace(0, len(self.texts), len(paths) + 1).astype(int)
        return int(sizes[[str(p) for p in paths].index(input_path)]) + record - 1


def _near(rng, text: str, vocabulary: list[str]) -> str | None:
    words = text.split(" ")
    for _ in range(20):
        if rng.random() < 0.5:  # a few percent of the words changed
            changed = list(words)
            for i in rng.choice(len(words), max(1, int(len(words) * rng.uniform(0.01, 0.03))), replace=False):
                changed[i] = str(rng.choice(vocabulary))
            candidate = " ".join(changed)
        else:  # the end cut off
            candidate = " ".join(words[: len(words) - max(1, int(len(words) * rng.uniform(0.02, 0.08)))])
        if candidate != text and jaccard(candidate, text) >= 0.85:
            return candidate
    return None


def planted_corpus(n: int = 1500, exact: int = 75, near: int = 150, seed: int = 0) -> Corpus:
    rng = np.random.default_rng(seed)
    base = novel_paragraphs(n)
    vocabulary = sorted({w for t in base[:200] for w in t.split()})
    keyed = [(float(i), t, None, None) for i, t in enumerate(base)]
    for kind, count in (("exact", exact), ("near", near)):
        for i in rng.choice(len(base), count, replace=False).tolist():
            if kind == "exact":  # the same text, sometimes re-wrapped (equal after whitespace normalisation)
                text = base[i] if rng.random() < 0.5 else base[i].replace(" ", "\n", 3).replace(". ", ".  ")
            else:
                text = _near(rng, base[i], vocabulary)
                if text is None:
                    continue
            keyed.append((float(rng.uniform(i + 0.5, len(base))), text, kind, i))
    keyed.sort(key=lambda k: k[0])
    position = {int(k[0]): j for j, k in enumerate(keyed) if k[2] is None}
    corpus = Corpus([k[1] for k in keyed], {}, {})
    for j, (_, _, kind, original) in enumerate(keyed):
        if kind is not None:
            (corpus.exact if kind == "exact" else corpus.near)[j] = position[original]
    return corpus
