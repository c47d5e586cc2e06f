"""Builds the optional C fast path of small collectives (ringlet/transport/_fastpath.c).
Everything else is declared in pyproject.toml; without a C compiler the install still
succeeds and ringlet runs in pure Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ringlet.transport._fastpath", ["ringlet/transport/_fastpath.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall"], optional=True)])
