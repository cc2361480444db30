"""The gRPC stubs the build generated match protos/ and the installed grpcio-tools."""

from __future__ import annotations

import pathlib
import shutil

from jaxserve.server import protogen

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current():
    assert protogen.stale(REPO) == [], "regenerate the stubs: pip install -e . (setup.py runs protogen)"


def test_an_edited_proto_makes_the_stubs_stale(tmp_path):
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copytree(REPO / protogen.PACKAGE_DIR, tmp_path / protogen.PACKAGE_DIR)
    proto = tmp_path / "protos" / "jaxserve.proto"
    proto.write_text(
        proto.read_text().replace("message ListModelsRequest {}", "message ListModelsRequest { string filter = 1; }")
    )
    assert sorted(protogen.stale(tmp_path)) == ["jaxserve_pb2.py", "jaxserve_pb2.pyi"]
