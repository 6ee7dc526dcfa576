"""Regenerate the committed gRPC modules from the project's .proto files.

Usage: python -m pdserve.protocol.generate
The modules are committed next to their .proto so that running pdserve needs no code
generator; a test regenerates them into a temporary folder and checks they are identical.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = (
    ROOT / "pdserve" / "protocol" / "worker.proto",
    ROOT / "kv_transfer" / "kv_wire.proto",
)


def generated_names(proto: Path) -> tuple[str, ...]:
    stem = proto.stem
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def generate(proto: Path, output_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{proto.parent}",
        f"--python_out={output_dir}",
        f"--pyi_out={output_dir}",
        f"--grpc_python_out={output_dir}",
        proto.name,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")
    # protoc writes `import x_pb2`; make it a package-relative import.
    grpc_module = output_dir / f"{proto.stem}_pb2_grpc.py"
    alias = proto.stem.replace("_", "__") + "__pb2"
    grpc_module.write_text(
        grpc_module.read_text().replace(
            f"import {proto.stem}_pb2 as {alias}", f"from . import {proto.stem}_pb2 as {alias}"
        )
    )


if __name__ == "__main__":
    for proto in PROTOS:
        generate(proto, proto.parent)
