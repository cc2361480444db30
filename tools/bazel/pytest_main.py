"""Bazel's entry point for a pytest file: `bazel test` runs each py_test through this with the file as argument."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
