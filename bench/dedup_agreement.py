"""``preprocess --dedup minhash`` against datatrove's MinHash pipeline (its defaults) on every paragraph
of the shared novels with at least 30 words, plus planted duplicates (5% exact copies, 10% near copies:
``tests/preprocess/dedup_corpus.planted_corpus``, the test module's corpus at full size). Prints the
agreement of the removed sets (Jaccard), each side's recall of the planted duplicates and what else
each removed. About a minute on the 2-core box (datatrove's side is most of it); datatrove is a
test-only oracle (the dev extra).

    TOKENLOOM_SHARED_DATA=../shared/data .venv/bin/python bench/dedup_agreement.py
"""

import json
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "preprocess")]

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from dedup_corpus import novel_paragraphs, planted_corpus  # noqa: E402
from preprocess_helpers import preprocess  # noqa: E402
from tl_testing import patch_datatrove_xxhash  # noqa: E402


def main() -> None:
    n = len(novel_paragraphs(10**9))
    corpus = planted_corpus(n=n, exact=n // 20, near=n // 10)
    print("paragraphs", n, "documents", len(corpus.texts), "planted exact", len(corpus.exact), "near", len(corpus.near), flush=True)
    tmp = Path(tempfile.mkdtemp())
    paths = corpus.write(tmp, parts=3)
    t = time.time()
    ours_prefix = preprocess(tmp, paths, name="ours", dedup="minhash", append_eod=True, workers=2)
    print("ours", round(time.time() - t, 1), "s", flush=True)
    removed = [json.loads(line) for line in Path(f"{ours_prefix}.removed.jsonl").read_text().splitlines()]
    ours = {corpus.index(paths, r["input"], r["record"]) for r in removed}
    from datatrove import data  # noqa: E402
    from datatrove.pipeline.dedup import minhash as dedup  # noqa: E402

    patch_datatrove_xxhash(pytest.MonkeyPatch())
    config = dedup.MinhashConfig()
    t = time.time()
    documents = [data.Document(text=x, id=str(i)) for i, x in enumerate(corpus.texts)]
    dedup.MinhashDedupSignature(output_folder=str(tmp / "sigs"), config=config).run(documents)
    b = dedup.MinhashDedupBuckets(input_folder=str(tmp / "sigs"), output_folder=str(tmp / "buckets"), config=config)
    for k in range(config.num_buckets):
        b.run(rank=k, world_size=config.num_buckets)
    dedup.MinhashDedupCluster(input_folder=str(tmp / "buckets"), output_folder=str(tmp / "remove"), config=config).run()
    theirs = set(np.frombuffer((tmp / "remove" / "000000.remove").read_bytes(), "<u4").tolist())
    print("datatrove", round(time.time() - t, 1), "s")
    planted = set(corpus.exact) | set(corpus.near)
    print(f"ours {len(ours)} theirs {len(theirs)} agreement (Jaccard of removed sets) {len(ours & theirs) / len(ours | theirs):.4f}")
    print(f"recall of planted: ours {len(ours & planted) / len(planted):.4f} theirs {len(theirs & planted) / len(planted):.4f}; "
          f"not planted among removed: ours {len(ours - planted)} theirs {len(theirs - planted)}")


if __name__ == "__main__":
    main()
