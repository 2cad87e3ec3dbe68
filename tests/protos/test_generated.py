"""The committed gRPC modules are what protos/specserve.proto generates (regenerate: `make protos`)."""
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_modules_match_the_proto(tmp_path):
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "specserve.proto").write_text((ROOT / "protos" / "specserve.proto").read_text())
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            str(tmp_path / "protos" / "specserve.proto")]
    assert protoc.main(args) == 0
    for name in ("specserve_pb2.py", "specserve_pb2_grpc.py"):
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), f"{name} is stale: run make protos"


def test_service_has_the_methods_the_router_serves():
    from protos import specserve_pb2

    service = specserve_pb2.DESCRIPTOR.services_by_name["SpecServe"]
    assert {m.name for m in service.methods} == {"Generate", "GenerateStream", "ListModels"}
    assert service.methods_by_name["GenerateStream"].server_streaming
