"""README.md and docs/ against the code (tests/docs_check.py says how each check reads the pages):
the runnable blocks run, the flags exist, the quoted defaults are the code's, the field table is
generated; each check also fails on a violation planted in a copy of the pages."""

from __future__ import annotations

import re

import click
import pytest
from docs_check import (
    PAGES,
    REPO,
    default_errors,
    field_errors,
    flag_errors,
    read_pages,
    run_blocks,
    shell_blocks,
)
from test_docstrings import PATTERNS
from tl_testing import limit_s


@pytest.fixture(scope="module")
def pages():
    return read_pages()


def test_readme_fits_a_screen_and_a_half(pages):
    assert len(pages["README.md"].splitlines()) <= 250


def test_readme_links_every_page(pages):
    missing = [p for p in PAGES[1:] if f"({p})" not in pages["README.md"]]
    assert not missing, f"README.md links none of {missing}"


def test_every_page_starts_with_commands(pages):
    # the first block of a page comes before its second heading: commands first, prose after
    late = [n for n, t in pages.items() if n.startswith("docs/") and n != "docs/config.md"
            and (not shell_blocks(t) or t.find("```") > t.find("\n## ") > 0)]
    assert not late, f"pages whose first shell block is not in their first section: {late}"


def test_every_flag_named_exists(pages):
    assert flag_errors(pages) == []


def test_every_default_quoted_is_the_codes(pages):
    assert sum(t.count("<!-- default: ") for t in pages.values()) >= 6
    assert default_errors(pages) == []


def test_the_field_table_is_the_codes(pages):
    assert field_errors(pages) == []


def test_docs_name_every_command_and_train_flag(pages):
    from tokenloom.cli import main  # lazy: importing the CLI imports torch; the text checks need neither

    docs = "\n".join(t for n, t in pages.items() if n.startswith("docs/"))
    missing = []
    for name, cmd in main.commands.items():
        subs = cmd.commands.items() if isinstance(cmd, click.Group) else [("", cmd)]
        for sub, _ in subs:
            if not re.search(rf"cli\.py {name}{' ' + sub if sub else ''}\b", docs):
                missing.append(f"cli.py {name} {sub}".strip())
    train = main.commands["train"]
    missing += [p.opts[0] for p in train.params if isinstance(p, click.Option) and p.opts[0] != "--help"
                and not re.search(rf"{re.escape(p.opts[0])}(?![\w-])", docs)]
    assert not missing, f"docs/ never names: {missing}"


def test_no_measurement_is_quoted_in_prose(pages):
    found = [f"{n}: {m.group(0)!r}" for n, t in pages.items() for kind in ("ratio", "time")
             for m in PATTERNS[kind].finditer(t)]
    assert not found, f"measurements belong in bench/RESULTS.md (link it): {found}"


# The runnable blocks: preprocess tinyshakespeare, build, a 2-step train, config show, inspect,
# verify and a dry-run build: about 20 s of CPU, up to 70 s on the shared 2-core dev box under
# load, hence a timeout of 900 (0.1 of it is 90 s).
@pytest.mark.timeout(900)
def test_runnable_blocks_run(pages, tmp_path, shared_data):
    assert sum(r for t in pages.values() for _, _, r in shell_blocks(t)) >= 4
    assert run_blocks(pages, tmp_path, shared_data, timeout=limit_s(300)) == []


# --- each check fails on a planted violation -------------------------------------------------

def test_a_planted_wrong_flag_fails(pages):
    planted = dict(pages)
    planted["docs/train.md"] += "\n```bash\npython cli.py train --mock-data --train-itres 2\n```\n"
    assert any("has no --train-itres" in e for e in flag_errors(planted))
    planted["docs/train.md"] += "\n```bash\npython cli.py train --set optim.lrr=1\n```\n"
    assert any("--set optim.lrr" in e for e in flag_errors(planted))
    planted["docs/train.md"] += "\nThe `--eval-intervall` flag.\n"
    assert any("no command has --eval-intervall" in e for e in flag_errors(planted))


def test_a_planted_stale_default_fails(pages):
    planted = dict(pages)
    text = planted["README.md"]
    assert "<!-- default: kernels-auto:cuda --> `reference`" in text
    planted["README.md"] = text.replace("<!-- default: kernels-auto:cuda --> `reference`",
                                        "<!-- default: kernels-auto:cuda --> `triton`")
    assert any("kernels-auto:cuda is `triton`" in e for e in default_errors(planted))
    planted["README.md"] = text + "\n<!-- default: async_save --> `false` by default\n"
    assert any("async_save is `false`" in e for e in default_errors(planted))


def test_a_removed_config_field_fails(pages):
    planted = dict(pages)
    planted["docs/config.md"] = re.sub(r"^\| `async_save` \|.*\n", "", pages["docs/config.md"], flags=re.MULTILINE)
    assert "docs/config.md: field async_save is missing" in field_errors(planted)
    planted["docs/config.md"] = pages["docs/config.md"].replace("| `async_save` |", "| `async_saving` |")
    assert "docs/config.md: field async_saving is no config field" in field_errors(planted)


def test_a_failing_runnable_block_fails(tmp_path):
    page = "<!-- runnable -->\n```bash\npython cli.py verify no/such/prefix\n```\n"
    errors = run_blocks({"README.md": page}, tmp_path, REPO, timeout=limit_s(60))
    assert len(errors) == 1 and errors[0].startswith("README.md:3: exit 1\n")
