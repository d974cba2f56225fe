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


if __name__ == "__main__":
    main()
