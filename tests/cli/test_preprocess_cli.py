"""preprocess/tokenizer/build from the command line, with Megatron-style multi-value flags."""

from __future__ import annotations

import json

from tl_testing import run_cli

from tokenloom.indexed import IndexedDataset


def _jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_megatron_style_multi_value_flags(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"text": "abc", "title": "A"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": "de", "title": "B"}, {"text": "", "title": ""}])
    out = run_cli("preprocess", "--input", a, b, "--json-keys", "text", "title", "--output-prefix", tmp_path / "o",
                  "--tokenizer-type", "byte", "--append-eod", "--workers", "2", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert IndexedDataset(tmp_path / "o_text").num_documents == 3
    assert IndexedDataset(tmp_path / "o_title").num_tokens == 4  # "A"+eod, "B"+eod, "" (empty)
    built = run_cli("build", "--data", "0.5", tmp_path / "o_text", "0.5", tmp_path / "o_title", "--split", "1",
                    "--seq-length", "2", "--num-samples", "3", "--json")
    assert built.returncode == 0, built.stderr
    assert [r["requested"] for r in json.loads(built.stdout)["plan"]] == [0.5, 0.5]


def test_tokenizer_train_then_preprocess(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": f"line {i} of a tiny corpus, again and again"} for i in range(200)])
    out = run_cli("tokenizer", "train", "--input", corpus, "--kind", "bpe", "--vocab-size", "300", "--output",
                  tmp_path / "tok")
    assert out.returncode == 0, out.stderr
    fp = json.loads(run_cli("tokenizer", "inspect", tmp_path / "tok").stdout)
    assert fp["kind"] == "hf" and 257 < fp["vocab_size"] <= 300  # a tiny corpus may run out of merges
    out = run_cli("preprocess", "--input", corpus, "--output-prefix", tmp_path / "p", "--tokenizer", tmp_path / "tok",
                  "--append-eod", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert run_cli("verify", tmp_path / "p", "--vocab-size", fp["vocab_size"], "--eod", fp["eod"]).returncode == 0


def test_a_missing_json_key_lists_the_keys_the_record_has(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "abc", "meta": {"lang": "en"}}])
    done = run_cli("preprocess", "--input", corpus, "--json-keys", "content", "--output-prefix", tmp_path / "o",
                   "--tokenizer-type", "byte", "--no-progress")
    assert done.returncode != 0
    assert done.stderr.strip() == (f"error: {corpus}:1: missing key 'content' (the record's keys: 'text', 'meta'; "
                                   "choose with --json-keys)")
    done = run_cli("tokenizer", "train", "--input", corpus, "--json-keys", "content", "--vocab-size", "300",
                   "--output", tmp_path / "tok")
    assert done.returncode != 0 and "missing key 'content' (the record's keys: 'text', 'meta'" in done.stderr


def test_tokenizer_train_warns_when_the_vocabulary_falls_short(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"body": "the same few words, again"}] * 50)
    done = run_cli("tokenizer", "train", "--input", corpus, "--json-keys", "body", "--vocab-size", "32000",
                   "--output", tmp_path / "tok")
    assert done.returncode == 0, done.stderr
    got = json.loads(run_cli("tokenizer", "inspect", tmp_path / "tok").stdout)["vocab_size"]
    assert got < 400
    assert done.stderr.strip() == (f"warning: the trained vocabulary has {got} ids, fewer than --vocab-size 32000: "
                                   f"after {got} ids no pair of tokens occurs --min-frequency 2 times in the input; "
                                   "more text (or a lower --min-frequency) gives more ids")


def test_an_output_directory_that_cannot_be_created_is_named(tmp_path):
    from click.testing import CliRunner

    from tokenloom.cli import main

    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "abc"}])
    (tmp_path / "a-file").write_text("")
    for prefix, folder, why in [("/proc/x/out", "/proc/x", "No such file or directory"),
                                (f"{tmp_path}/a-file/out", f"{tmp_path}/a-file/out.partial", "Not a directory")]:
        done = CliRunner().invoke(main, ["preprocess", "--input", str(corpus), "--output-prefix", prefix,
                                         "--tokenizer-type", "byte", "--no-progress"])
        assert done.exit_code == 1 and "Traceback" not in done.output
        assert done.stderr.strip() == (f"error: cannot create the directory {folder} ({why}) for the output "
                                       f"{prefix}: choose an --output-prefix (or --staging-dir) in a location "
                                       "this user can create and write"), done.stderr
