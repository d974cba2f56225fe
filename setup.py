"""Native build: compiles csrc/ into ``tokenloom._native`` with pybind11 at install time.

The extension is optional in the same sense as Megatron's: if no C++ compiler is
available the install still succeeds and tokenloom falls back to its numpy
references (with one warning at run time). Unlike Megatron, nothing is ever
compiled at run time.
"""

import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


class OptionalBuildExt(build_ext):
    """Build the extension, but never fail the install because of it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            print(f"WARNING: tokenloom native extension not built ({exc}); numpy fallback will be used",
                  file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"WARNING: could not build {ext.name} ({exc}); numpy fallback will be used", file=sys.stderr)


ext_modules = [
    Pybind11Extension(
        "tokenloom._native",
        sorted(["csrc/helpers.cpp"]),
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
