"""The ``tokenloom`` command. Each command parses options and calls one library function.

User errors (:class:`tokenloom.errors.TokenloomError`) are printed as one line on
stderr with a non-zero exit status; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import click

from tokenloom.errors import TokenloomError


class _Group(click.Group):
    """A click group that turns user errors into one-line messages."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TokenloomError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            click.echo(f"error: {exc.strerror}: {exc.filename}", err=True)
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tokenloom")
def main():
    """tokenloom: raw text -> Megatron .bin/.idx -> blends -> a trained GPT."""


@main.command()
def info():
    """Print versions, the native extension's state and the torch devices/backends."""
    from tokenloom.info import collect

    facts = collect()
    width = max(map(len, facts))
    for key, value in facts.items():
        click.echo(f"{key:<{width}}  {value}")


def _emit(report: dict, as_json: bool) -> None:
    """Print a report as JSON, or as aligned ``key  value`` lines (nested dicts flattened)."""
    if as_json:
        import json

        click.echo(json.dumps(report, indent=2))
        return
    flat: dict[str, object] = {}
    for key, value in report.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    width = max(map(len, flat))
    for key, value in flat.items():
        click.echo(f"{key:<{width}}  {value}")


@main.command()
@click.argument("prefix")
@click.option("--no-hash", is_flag=True, help="Skip the token-stream SHA-256 (reads every token).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(prefix, no_hash, as_json):
    """Counts, dtype, length distribution and token SHA-256 of PREFIX.bin/.idx."""
    from tokenloom.indexed import inspect as run

    _emit(run(prefix, with_hash=not no_hash), as_json)


@main.command()
@click.argument("prefix")
@click.option("--vocab-size", type=int, help="Also check that every token id is below this.")
@click.option("--eod", type=int, help="Also check that every non-empty document ends with this id.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(prefix, vocab_size, eod, as_json):
    """Check PREFIX.bin/.idx completely; exit non-zero naming the first problem."""
    from tokenloom.indexed import verify as run

    report = run(prefix, vocab_size=vocab_size, eod=eod)
    if as_json:
        _emit(report, True)
    else:
        click.echo(f"OK {report['path_prefix']}: {report['sequences']} sequences, {report['documents']} "
                   f"documents, {report['tokens']} tokens ({report['dtype']}); checked "
                   f"{', '.join(report['checked'])}")


@main.command()
@click.option("--output-prefix", required=True, help="Prefix of the merged PREFIX.bin/.idx.")
@click.argument("prefixes", nargs=-1, required=True)
def merge(output_prefix, prefixes):
    """Concatenate datasets PREFIXES (in order) into one; token dtypes must agree."""
    from tokenloom.indexed import merge as run

    _emit(run(output_prefix, list(prefixes)), False)


@main.command()
@click.option("--output-dir", default="demo-out", show_default=True, help="Where the demo writes its files.")
@click.option("--max-documents", default=400, show_default=True, help="Python stdlib modules in the corpus.")
def demo(output_dir, max_documents):
    """Run the embedded default job end to end (no download): corpus -> tokens -> inspect -> verify."""
    from tokenloom.demo import DemoConfig, run

    run(DemoConfig(output_dir=output_dir, max_documents=max_documents), echo=click.echo)


if __name__ == "__main__":
    main()
