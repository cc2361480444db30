"""Build hook: generate the gRPC stubs (jaxserve/server/proto/) from protos/ before the package is collected.
Everything else about the package is in pyproject.toml."""

import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).parent.resolve()


class BuildWithProtos(build_py):
    def run(self):
        spec = importlib.util.spec_from_file_location("protogen", ROOT / "jaxserve/server/protogen.py")
        protogen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(protogen)
        protogen.generate(ROOT, ROOT)
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
