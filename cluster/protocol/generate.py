"""Regenerate the committed gRPC modules from worker.proto.

Usage: python -m cluster.protocol.generate [OUTPUT_DIR]
The modules are committed so that running pdserve needs no code generator; a test runs this
into a temporary folder and checks the committed files are identical.
"""

import sys
from pathlib import Path

PROTOCOL_DIR = Path(__file__).resolve().parent
PROTO = "worker.proto"
GENERATED = ("worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py")


def generate(output_dir: Path) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTOCOL_DIR}", f"--python_out={output_dir}",
            f"--pyi_out={output_dir}", f"--grpc_python_out={output_dir}", PROTO]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTOCOL_DIR / PROTO}")
    # protoc writes `import worker_pb2`; make it a package-relative import.
    grpc_module = output_dir / "worker_pb2_grpc.py"
    grpc_module.write_text(grpc_module.read_text().replace(
        "import worker_pb2 as worker__pb2", "from . import worker_pb2 as worker__pb2"))


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTOCOL_DIR)
