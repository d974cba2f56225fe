"""The quality filters decide as datatrove's (0.10.x, the test-only oracle) on the same text.

Every filter's decision and reason name (and C4's kept text) is compared with datatrove's
``GopherQualityFilter``, ``GopherRepetitionFilter``, ``C4QualityFilter`` and
``FineWebQualityFilter`` on the shared corpora, cut as a user would: tinyshakespeare's records
(paragraphs), the lines of its ``input.txt`` (short documents), WikiText-2's records
(articles) and the English novels cut into ~4 KB documents at line boundaries. Both sides split
words with spaCy, which is most of the time, and datatrove's split runs in spaCy's
``memory_zone`` (slower again); the novels are 50 M characters, minutes of datatrove, so CI
takes every 120th novel document and every 20th shakespeare line (deterministic strides).
``TOKENLOOM_FILTERS_ALL=1`` takes every document of every corpus (the report of the branch
that added this quotes that run). Crafted texts aim at each rule (each reason name is seen at
least once), and a few non-default configs are compared too.

datatrove runs offline: its English word tokenizer is spaCy's blank English pipeline, whose
rules ship in the spaCy wheel (a product dependency), and these filters download nothing.
Two oracle quirks, where datatrove's result depends on the texts before (see
``tokenloom.clean.words``), are set aside: the spaCy length limit is lifted before each C4
call, and datatrove gets a fresh spaCy pipeline before a text holding ``IS_ALPHA``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import zstandard

from tokenloom.clean import words
from tokenloom.clean.filters import (
    C4,
    FILTER_NAMES,
    FilterConfigError,
    FineWeb,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    build_filters,
)

dt_filters = pytest.importorskip("datatrove.pipeline.filters",
                                 reason="datatrove not installed (the dev extra installs it)")
from datatrove.data import Document  # noqa: E402
from datatrove.utils import text as dt_text  # noqa: E402
from datatrove.utils.word_tokenizers import load_word_tokenizer  # noqa: E402

# The corpus fixture runs both sides over ~5 M characters (CPU-bound, single process): well under
# a tenth of 600 s here, with room for a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ALL = os.environ.get("TOKENLOOM_FILTERS_ALL", "") == "1"
NOVEL_STRIDE = 1 if ALL else 120
LINE_STRIDE = 1 if ALL else 20
NOVEL_DOC_CHARS = 4096


# --------------------------------------------------------------------------- the oracle


def oracle(name: str, config: object | None = None):
    """datatrove's filter of our ``name`` with the thresholds of ``config`` (ours), as a callable
    text -> (keep, reason, text after)."""
    kwargs = {} if config is None else dict(vars(config))
    if name == "gopher_quality":
        kwargs["stop_words"] = list(kwargs.get("stop_words", GopherQualityConfig.stop_words))
        f = dt_filters.GopherQualityFilter(**kwargs)
    elif name == "gopher_repetition":
        f = dt_filters.GopherRepetitionFilter(**kwargs)
    elif name == "c4":
        kwargs.pop("remove_lines", None)
        f = dt_filters.C4QualityFilter(**kwargs)
    else:
        if "stop_chars" in kwargs:
            kwargs["stop_chars"] = tuple(kwargs["stop_chars"])
        f = dt_filters.FineWebQualityFilter(**kwargs)
    spacy_tokenizer = load_word_tokenizer("eng")

    def run(text: str) -> tuple[bool, str | None, str]:
        doc = Document(text=text, id="doc")
        if name == "c4":  # the quirks in the module docstring
            spacy_tokenizer.tokenizer.max_length = 1 << 62
        if "IS_ALPHA" in text:
            spacy_tokenizer._tokenizer = None
        result = f.filter(doc)
        keep, reason = result if isinstance(result, tuple) else (result, None)
        return bool(keep), reason, doc.text

    return run


def decide_ours(f, text: str) -> tuple[bool, str | None, str | None]:
    if isinstance(f, C4):
        kept, why = f.judge(text)
        return kept is not None, why, kept
    why = f.reason(text)
    return why is None, why, None


def disagreements(ours_side: list, theirs: list, texts: list[str], c4: bool) -> list[str]:
    """One line per document where the decision, the reason or (C4, kept) the text differs."""
    out = []
    for i, (a, b) in enumerate(zip(ours_side, theirs, strict=True)):
        if a[0] != b[0] or a[1] != b[1] or (c4 and a[0] and a[2] != b[2]):
            out.append(f"doc {i}: ours {a[:2]} datatrove {b[:2]}: {texts[i][:120]!r}")
    return out


# --------------------------------------------------------------------------- corpora


def novel_documents(path) -> list[str]:
    raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb")).read().decode("utf-8")
    docs = []
    for record in raw.splitlines():
        piece: list[str] = []
        size = 0
        for line in json.loads(record)["text"].splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= NOVEL_DOC_CHARS:
                docs.append("".join(piece))
                piece, size = [], 0
        if piece:
            docs.append("".join(piece))
    return docs


def jsonl_texts(path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def corpora(shared_data) -> dict[str, list[str]]:
    return {
        "tinyshakespeare paragraphs": jsonl_texts(shared_data / "tinyshakespeare" / "tinyshakespeare.jsonl"),
        "tinyshakespeare lines": (shared_data / "tinyshakespeare" / "input.txt").read_text().split("\n")[::LINE_STRIDE],
        "wikitext-2 articles": jsonl_texts(shared_data / "wikitext-2" / "wikitext-2.jsonl"),
        "english novels 4 KB": novel_documents(shared_data / "english-novels" / "english_novels.jsonl.zst")[::NOVEL_STRIDE],
    }


@pytest.fixture(scope="module")
def corpus_results(corpora) -> dict[tuple[str, str], tuple[list, list, list[str]]]:
    """(corpus, filter) -> (our decisions, datatrove's, texts); the four filters run on each
    document in turn, as a pipeline does (so both sides split a document's words once)."""
    mine = build_filters(FILTER_NAMES)
    theirs = [oracle(name) for name in FILTER_NAMES]
    out = {}
    for corpus, texts in corpora.items():
        started = time.process_time()
        a = [[decide_ours(f, t) for f in mine] for t in texts]
        middle = time.process_time()
        b = [[run(t) for run in theirs] for t in texts]
        print(f"{corpus}: {len(texts)} documents, ours {middle - started:.1f} s, "
              f"datatrove {time.process_time() - middle:.1f} s (CPU)")
        for k, name in enumerate(FILTER_NAMES):
            out[(corpus, name)] = ([r[k] for r in a], [r[k] for r in b], texts)
    return out


CORPORA = ("tinyshakespeare paragraphs", "tinyshakespeare lines", "wikitext-2 articles", "english novels 4 KB")


@pytest.mark.parametrize("name", FILTER_NAMES)
@pytest.mark.parametrize("corpus", CORPORA)
def test_decisions_equal_datatrove_on_shared_corpora(corpus_results, corpus, name):
    mine, theirs, texts = corpus_results[(corpus, name)]
    assert len(texts) > 50
    bad = disagreements(mine, theirs, texts, name == "c4")
    kept = sum(k for k, _, _ in theirs)
    print(f"{corpus} / {name}: {len(texts)} documents, {kept} kept, {len(bad)} disagreements")
    assert not bad, "\n".join(bad[:10])


def test_the_corpora_exercise_both_decisions(corpus_results):
    """Each filter keeps some documents and removes some, so equal decisions mean something."""
    for name in FILTER_NAMES:
        decided = {k for corpus in CORPORA for k, _, _ in corpus_results[(corpus, name)][1]}
        assert decided == {True, False}, name


# --------------------------------------------------------------------------- crafted texts

PROSE = ("The old man walked to the river with his dog and sat down on the bank. He had come "
         "there every morning for years, and he knew that the water would be cold. Nothing in "
         "the world could have kept him away from that place, not the rain and not the snow. "
         "His daughter said that he should stay at home with the fire, but he only laughed.")
LINES = "\n".join(f"Line number {i} of the story goes on here, and it ends well." for i in range(8))

CRAFTED: dict[str, str] = {
    "empty": "",
    "whitespace": " \n\n \t ",
    "newline": "\n",
    "all punctuation": "!!! ??? ... ,,, ;;; --- ((( ))) ### " * 20,
    "prose": PROSE,
    "prose lines": LINES,
    "short": "The cat sat on the mat.",
    "short words": " ".join(["a b c of to the"] * 12) + ".",
    "long words": " ".join(["incomprehensibilities extraordinarily the of"] * 15) + ".",
    "hashes": PROSE + " #tag" * 12,
    "ellipsis marks": PROSE + " wait..." * 14,
    "unicode ellipsis": PROSE + " wait…" * 14,
    "bullet lines": "\n".join(f"• item {i} of the list and the rest" for i in range(30)),
    "dash lines": "\n".join(f"- item {i} of the list and the rest" for i in range(30)),
    "mixed bullets": "\n".join(f"{'•-'[i % 2]} item {i} of the list" if i % 10 else PROSE for i in range(30)),
    "ellipsis lines": "\n".join(f"And then the man said that {i} ..." if i % 2 else PROSE for i in range(10)),
    "unicode ellipsis lines": "\n".join(f"And so to the end {i}…" if i % 3 else PROSE for i in range(9)),
    "numbers": PROSE + " " + " ".join(str(i) for i in range(300)),
    "no stop words": " ".join(["Dog runs fast across green fields today"] * 10) + ".",
    "capital stop words": " ".join(["The dog And cat With bird Have fun"] * 10) + ".",
    "one stop word": " ".join(["the dog runs fast across green fields"] * 10) + ".",
    "repeated paragraphs": "\n\n".join([PROSE, "A different paragraph here.", PROSE, PROSE]),
    "repeated paragraph chars": "\n\n".join([PROSE, "A short one.", "Another short one here.", PROSE]),
    "repeated lines": "\n".join(["same line of text here"] * 5 + ["other", "more"] + [PROSE]),
    "repeated line chars": "\n".join([PROSE, "one line of many words that repeats now", PROSE[:90],
                                      "one line of many words that repeats now"] + [f"x{i}" for i in range(10)]),
    "newline runs": PROSE + "\n\n\n\n" + PROSE[::-1] + "\n\n\n",
    "top 2-gram": PROSE + " " + "big dog " * 30,
    "top 3-gram": PROSE + " " + " ".join(f"red big dog w{i}" for i in range(25)),
    "top 4-gram": PROSE + " " + " ".join(f"a red big dog {i}" for i in range(25)),
    "top n-gram tie, long first": PROSE + " " + " ".join(["extraordinary things"] * 9 + ["a b"] * 9),
    "top n-gram tie, short first": PROSE + " " + " ".join(["a b"] * 9 + ["extraordinary things"] * 9),
    "dup 5-grams": PROSE + " " + PROSE[:150] + " " + PROSE[:150],
    "dup 10-grams": PROSE + " " + " ".join(PROSE.split()[:12]),
    "joined n-grams collide": " ".join(["ab c d e f", "a bc d e f"] * 6) + " " + PROSE,
    "c4 kept": "\n".join(f"This is sentence number {i} of the page. It ends well!" for i in range(4)),
    "c4 five sentences": "\n".join(f"This is line {i} of the page." for i in range(5)),
    "c4 four sentences": "\n".join(f"This is line {i} of the page." for i in range(4)),
    "c4 lorem ipsum": LINES + "\nLorem ipsum dolor sit amet, consectetur.",
    "c4 lorem ipsum unkept": LINES + "\nLorem ipsum dolor sit amet",
    "c4 curly bracket": LINES + "\nThe function f {x} is defined here.",
    "c4 curly bracket unkept": LINES + "\nfunction f() { return 1 }",
    "c4 javascript": LINES + "\nPlease enable JavaScript to view this page.\nThe end of the line is here.",
    "c4 policy": LINES + "\nRead our Privacy Policy before you go.\nThis site uses cookies, you know.",
    "c4 terms": LINES + "\nBy using it you agree to the Terms of Use.",
    "c4 citations": "\n".join(["The sky is blue.[1]", "Water is wet [2]", "Grass is green.[edit]",
                              "Fire is hot.[citation needed]", "Ice is cold [] here.", "Stone is hard.[12]",
                              "Wood is soft.[]"] * 2),
    "c4 ellipsis line": "\n".join(f"This goes on and on {i}..." if i % 2 else f"This ends at {i}." for i in range(14)),
    "c4 quotes": "\n".join(['He said "no more today."', "She said 'yes, more.'", 'They said "so it is"'] * 3),
    "c4 short lines": "\n".join(["Hi there.", "Go now!", "Why me?"] * 5 + ["This has enough words."]),
    "c4 long word": "\n".join([f"A word {'x' * 1001} is long.", f"A word {'y' * 1000} is fine."] * 5),
    "c4 sentences in lines": "\n".join(["One thing. Two things! Three things? Four.", "And a fifth one here."]),
    "c4 crlf": "\r\n".join(f"This is line {i} of the page." for i in range(6)),
    "fineweb no punct": "\n".join(f"a line without an end number {i}" for i in range(20)),
    "fineweb some punct": "\n".join(f"a line number {i} that is long enough{'.' if i % 8 == 0 else ''}"
                                    for i in range(24)),
    "fineweb short lines": "\n".join(["Short.", "Tiny one.", PROSE, "Also short.", "Yes."]),
    "fineweb dup lines": "\n".join([PROSE, "This line is repeated here.", PROSE[::-1], "This line is repeated here."]),
    "fineweb list": "\n".join(f"Entry {i}: yes." for i in range(40)) + "\n" + PROSE,
    "fineweb long list": "\n".join(f"Incomprehensibilities{i:04d}abcdefghij." for i in range(40)),
    "fineweb crlf": "\r\n".join([PROSE] * 1 + [f"More text here, line {i}." for i in range(3)]),
    "fineweb trailing space": "\n".join(f"This line number {i} ends with a space. " for i in range(10)),
    "fineweb cjk": "\n".join(f"这是第{i}行，它很长很长很长很长很长很长很长很长很长很长。" for i in range(10)),
    "unicode terminal": "\n".join(f"The line {i} of it ends in a mark that is long enough‼" for i in range(10)),
    "IS_ALPHA": PROSE + " IS_ALPHA is a name that once broke spaCy's tokenizer.",
    "control characters": PROSE + " \x00\x01\x0b\x0c\x1f\x7f\x85\x9f end.",
    "non-breaking spaces": PROSE.replace(" ", "\u00a0"),
    "zero-width spaces": PROSE.replace(" ", "\u200b "),
    "line separators": PROSE.replace(". ", ".\u2028") + "\u2029" + PROSE,
    "contractions": "I don't think we'll make it, can't you see? " * 10 + PROSE,
    "urls and emails": PROSE + " See https://example.com/a?b=c and mail me@example.org now. " * 3,
}

REASONS = {
    "gopher_quality": {"gopher_short_doc", "gopher_below_avg_threshold", "gopher_above_avg_threshold",
                       "gopher_too_many_hashes", "gopher_too_many_ellipsis", "gopher_too_many_bullets",
                       "gopher_too_many_end_ellipsis", "gopher_below_alpha_threshold", "gopher_enough_stop_words",
                       None},
    "gopher_repetition": {"empty", "dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac",
                          "top_2_gram", "top_3_gram", "top_4_gram", None} | {f"duplicated_{n}_n_grams" for n in (5,)},
    "c4": {"lorem_ipsum", "curly_bracket", "too_few_sentences", None},
    "fineweb": {"empty", "line_punct_ratio", "short_line_ratio", "char_dup_ratio", "list_ratio", None},
}


@pytest.mark.parametrize("name", FILTER_NAMES)
def test_crafted_texts_decide_as_datatrove(name):
    (mine,) = build_filters([name])
    theirs = oracle(name)
    texts = list(CRAFTED.values())
    a = [decide_ours(mine, t) for t in texts]
    b = [theirs(t) for t in texts]
    bad = disagreements(a, b, texts, name == "c4")
    assert not bad, "\n".join(f"{list(CRAFTED)[int(x.split(':')[0][4:])]}: {x}" for x in bad)
    missing = REASONS[name] - {why for _, why, _ in a}
    assert not missing, f"no crafted text gives {sorted(map(str, missing))}"


# Non-default thresholds, on crafted texts and a sample of the corpora: each config changes some
# decision against the defaults (checked), and still equals datatrove's with the same thresholds.
CONFIGS = [
    ("gopher_quality", {"min_doc_words": "10", "max_doc_words": "60", "min_stop_words": "3",
                        "stop_words": "the,of,and,a,to,in"}),
    ("gopher_quality", {"max_avg_word_length": "6", "max_non_alpha_words_ratio": "0.95", "max_bullet_lines_ratio": "0.5"}),
    ("gopher_repetition", {"dup_line_frac": "0", "dup_para_frac": "0", "top_n_grams": "2:0.05,5:0.1",
                           "dup_n_grams": "3:0.05,4:0.1"}),
    ("c4", {"split_paragraph": "false", "min_num_sentences": "2", "min_words_per_line": "5"}),
    ("c4", {"filter_no_terminal_punct": "false", "remove_citations": "no", "max_word_length": "-1",
            "filter_curly_bracket": "false", "min_num_sentences": "-1"}),
    ("fineweb", {"line_punct_exclude_zero": "true", "short_line_length": "50", "stop_chars": ".!?"}),
    ("fineweb", {"line_punct_thr": "0.5", "char_duplicates_ratio": "0.1", "new_line_ratio": "0.1"}),
]


@pytest.fixture(scope="module")
def override_results(corpora) -> list[tuple[list, list, list, list[str]]]:
    """Per config of CONFIGS: (ours, datatrove's, ours with defaults, texts); every config runs
    on a text in turn, so each side splits a text's words once."""
    texts = list(CRAFTED.values()) + corpora["tinyshakespeare paragraphs"][::50] + corpora["english novels 4 KB"][::4]
    mine = [build_filters([name], {f"{name}.{k}": v for k, v in overrides.items()})[0] for name, overrides in CONFIGS]
    defaults = [build_filters([name])[0] for name, _ in CONFIGS]
    theirs = [oracle(name, f.config) for (name, _), f in zip(CONFIGS, mine, strict=True)]
    a = [[decide_ours(f, t) for f in mine] for t in texts]
    b = [[run(t) for run in theirs] for t in texts]
    d = [[decide_ours(f, t) for f in defaults] for t in texts]
    return [([r[k] for r in a], [r[k] for r in b], [r[k] for r in d], texts) for k in range(len(CONFIGS))]


@pytest.mark.parametrize("k", range(len(CONFIGS)), ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_overridden_thresholds_decide_as_datatrove(override_results, k):
    mine, theirs, defaults, texts = override_results[k]
    assert not (bad := disagreements(mine, theirs, texts, CONFIGS[k][0] == "c4")), "\n".join(bad[:10])
    assert mine != defaults


def test_a_text_holding_is_alpha_gets_spacys_words_every_time():
    """datatrove's second split of such a text deletes ``IS_ALPHA`` (the spaCy quirk); ours does not."""
    text = CRAFTED["IS_ALPHA"]
    load_word_tokenizer("eng")._tokenizer = None
    first = dt_text.split_into_words(text)
    assert list(words.split_words(text)) == first and "IS_ALPHA" in first
    assert "IS_ALPHA" not in dt_text.split_into_words(text + "  ")  # datatrove's second time
    words.split_words.cache_clear()
    assert list(words.split_words(text + " ")) == first


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")
def test_where_datatrove_divides_by_zero_the_document_is_removed():
    (f,) = build_filters(["gopher_quality"], {"gopher_quality.min_doc_words": "0"})
    run = oracle("gopher_quality", f.config)
    for text in ("", " \n ", "\n\n"):
        with pytest.raises(ZeroDivisionError):
            run(text)
        assert not f.keep(text) and f.clean(text) is None
    assert run("The old man and the river.")[0] and f.keep("The old man and the river.")


# --------------------------------------------------------------------------- C4 text, clean()


def test_c4_clean_returns_the_kept_lines_and_keep_only_decides():
    text = "\n".join(["A title", *(f"This is sentence {i} of the page.[3]" for i in range(5)),
                      "Please enable JavaScript now.", "  The last line is here!  "])
    expected = "\n".join([*(f"This is sentence {i} of the page." for i in range(5)), "The last line is here!"])
    (c4,) = build_filters(["c4"])
    assert c4.keep(text) and c4.clean(text) == expected == oracle("c4")(text)[2]
    (unchanged,) = build_filters(["c4"], {"c4.remove_lines": "false"})
    assert unchanged.keep(text) and unchanged.clean(text) == text
    assert c4.clean("too short.") is None and not c4.keep("too short.")
    for f in build_filters(["gopher_quality", "gopher_repetition", "fineweb"]):
        assert f.clean(PROSE) in (PROSE, None) and (f.clean(PROSE) is not None) == f.keep(PROSE)


def test_words_and_sentences_equal_datatrove_splits():
    def theirs(split, text):
        tokenizer = load_word_tokenizer("eng")
        if "IS_ALPHA" in text:
            tokenizer._tokenizer = None  # the quirks in the module docstring
        tokenizer.tokenizer.max_length = 1 << 62
        return split(text)

    for text in [*CRAFTED.values(), PROSE * 3]:
        assert list(words.split_words(text)) == theirs(dt_text.split_into_words, text)
        assert words.split_sentences(text) == theirs(dt_text.split_into_sentences, text)
        assert words.count_sentences(text) == len(words.split_sentences(text))
        assert "".join(words.split_sentences(text)) == text


def test_character_sets_equal_datatrove():
    assert words.PUNCTUATION == dt_text.PUNCTUATION_SET
    assert set(words.TERMINAL_PUNCTUATION) == dt_text.TERMINAL_PUNCTUATION
    assert len(words.TERMINAL_PUNCTUATION) == len(dt_text.TERMINAL_PUNCTUATION)


def test_a_rebuilt_pipeline_splits_the_same(monkeypatch):
    text = PROSE + " Zyzzyva quixotic " * 3
    before = words.split_words(text)
    first = words._Pipeline.nlp
    monkeypatch.setattr(words, "VOCAB_LIMIT", 0)
    words.split_words.cache_clear()
    assert words.split_words(text) == before and words._Pipeline.nlp is not first


# --------------------------------------------------------------------------- build_filters


def test_build_filters_defaults_are_datatrove_defaults():
    built = build_filters(FILTER_NAMES)
    assert [f.name for f in built] == list(FILTER_NAMES) == ["gopher_quality", "gopher_repetition", "c4", "fineweb"]
    theirs = [dt_filters.GopherQualityFilter(), dt_filters.GopherRepetitionFilter(), dt_filters.C4QualityFilter(),
              dt_filters.FineWebQualityFilter()]
    for f, d in zip(built, theirs, strict=True):
        for field, value in vars(f.config).items():
            if field == "remove_lines":
                continue
            attr = {"short_line_thr": "short_line_threshold"}.get(field, field)
            got = getattr(d, attr)
            if field in ("stop_words", "stop_chars"):
                assert set(value) == set(got), field
            else:
                assert value == got and type(value) in (type(got), float), (f.name, field, value, got)


def test_overrides_are_converted_to_the_field_type():
    gq, rep, c4, fw = build_filters(FILTER_NAMES, {
        "gopher_quality.min_doc_words": "30", "gopher_quality.max_symbol_word_ratio": "0.2",
        "gopher_quality.stop_words": "the, of ,and", "gopher_repetition.top_n_grams": "2:0.25,3:0.2",
        "gopher_repetition.dup_line_frac": 0, "c4.split_paragraph": "False", "c4.min_num_sentences": -1,
        "fineweb.line_punct_exclude_zero": "yes", "fineweb.stop_chars": ".!", "fineweb.short_line_thr": 1,
    })
    assert isinstance(gq, GopherQuality) and gq.config.min_doc_words == 30
    assert gq.config.max_symbol_word_ratio == 0.2 and gq.config.stop_words == ("the", "of", "and")
    assert isinstance(rep, GopherRepetition) and rep.config.top_n_grams == ((2, 0.25), (3, 0.2))
    assert rep.config.dup_line_frac == 0.0 and isinstance(rep.config.dup_line_frac, float)
    assert isinstance(c4, C4) and c4.config.split_paragraph is False and c4.config.min_num_sentences == -1
    assert isinstance(fw, FineWeb) and fw.config.line_punct_exclude_zero is True and fw.config.stop_chars == ".!"
    assert fw.config.short_line_thr == 1.0
    assert build_filters([]) == []


@pytest.mark.parametrize("names, overrides, fragment", [
    (["gopher"], {}, "unknown filter 'gopher' (known: gopher_quality, gopher_repetition, c4, fineweb)"),
    (["c4", "c4"], {}, "filter 'c4' named twice"),
    (["c4"], {"c4.min_sentences": "3"}, "c4 has no field 'min_sentences'"),
    (["c4"], {"c4": "3"}, "expected NAME.FIELD"),
    (["c4"], {"c4.": "3"}, "expected NAME.FIELD"),
    (["c4"], {"fineweb.new_line_ratio": "0.2"}, "filter 'fineweb' is not among those chosen (c4)"),
    (["c4"], {"nope.x": "1"}, "unknown filter 'nope'"),
    (["c4"], {"c4.min_num_sentences": "2.5"}, "c4.min_num_sentences='2.5': expected an integer"),
    (["c4"], {"c4.min_num_sentences": True}, "expected an integer"),
    (["c4"], {"c4.filter_policy": "maybe"}, "expected true or false"),
    (["fineweb"], {"fineweb.new_line_ratio": "lots"}, "expected a number"),
    (["fineweb"], {"fineweb.stop_chars": ""}, "expected a non-empty string"),
    (["gopher_quality"], {"gopher_quality.stop_words": "the,,of"}, "expected comma-separated words"),
    (["gopher_repetition"], {"gopher_repetition.top_n_grams": "2-0.2"}, "expected N:FRACTION pairs"),
    (["gopher_repetition"], {"gopher_repetition.dup_n_grams": "0:0.2"}, "n-gram sizes of at least 1"),
])
def test_bad_names_fields_and_values_are_value_errors_naming_them(names, overrides, fragment):
    with pytest.raises(FilterConfigError) as caught:
        build_filters(names, overrides)
    assert isinstance(caught.value, ValueError) and fragment in str(caught.value)
