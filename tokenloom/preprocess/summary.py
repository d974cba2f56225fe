"""The summary a preprocess run returns (a dict, also written to done markers) and its table."""

from __future__ import annotations

from tokenloom.preprocess.config import Counts


def summarize(*, outputs: dict[str, str], inputs: int, shard: tuple[int, int], tokenizer, fingerprint: dict,
              dtype, counts: Counts, elapsed: float) -> dict:
    """The summary of a run over ``inputs`` inputs as shard ``(index, count)``, from its final counts."""
    c = counts
    tokens = sum(k["tokens"] for k in c.per_key.values())
    return {
        "outputs": dict(outputs),
        "inputs": inputs,
        "shard": f"{shard[0] + 1}/{shard[1]}",
        "tokenizer": f"{tokenizer.kind} (vocab {tokenizer.vocab_size}, {fingerprint['digest'][:12]})",
        "dtype": str(dtype),
        "records": c.records,
        "bad_records": c.bad_records,
        "removed": dict(c.removed),
        "per_key": c.per_key,
        "tokens": tokens,
        "bytes_in": c.bytes_in,
        "seconds": round(elapsed, 3),
        "tokens_per_second": round(tokens / max(elapsed, 1e-9)),
        "input_mb_per_second": round(c.bytes_in / 1e6 / max(elapsed, 1e-9), 2),
    }


def format_summary(summary: dict) -> str:
    rows = [("output", ", ".join(f"{k}: {v}" for k, v in summary["outputs"].items()))]
    rows += [(k, str(summary[k])) for k in ("inputs", "shard", "tokenizer", "dtype", "records", "bad_records")]
    if summary.get("removed"):
        rows.append(("removed", ", ".join(f"{reason} {n}" for reason, n in summary["removed"].items())))
    for key, c in summary["per_key"].items():
        rows.append((f"[{key}] documents", f"{c['documents']} ({c['empty_documents']} empty)"))
        rows.append((f"[{key}] sequences / tokens", f"{c['sequences']} / {c['tokens']}"))
    rows += [("input", f"{summary['bytes_in'] / 1e6:.2f} MB"), ("time", f"{summary['seconds']:.2f} s"),
             ("throughput", f"{summary['tokens_per_second'] / 1e3:.1f}k tokens/s, "
                            f"{summary['input_mb_per_second']:.2f} MB/s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
