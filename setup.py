"""Builds the one optional C helper (gateway/_opus_frames.c); everything else is in pyproject.toml. Without a C
compiler the build skips it and the gateway encodes Opus frame by frame through opuslib instead."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gateway._opus_frames", ["gateway/_opus_frames.c"], optional=True)])
