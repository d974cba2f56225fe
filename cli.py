#!/usr/bin/env python3
"""Thin entry point: ``python cli.py ...`` is the same as the installed ``tokenloom`` command."""

from tokenloom.cli import main

if __name__ == "__main__":
    main()
