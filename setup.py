"""The one native part of KVSP: :mod:`kvsp._sha256x2`, the two §6.7 SHA-256 passes interleaved
on the x86 SHA extensions. It is optional: where it cannot be built (no C compiler, not x86),
the install goes on and :mod:`kvsp.sha256x2` reports it missing, so clients hash with hashlib.
Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsp._sha256x2",
            ["kvsp/_sha256x2.c"],
            optional=True,  # a failed build leaves the hashlib path, not a failed install
        )
    ]
)
