"""The committed gRPC modules are exactly what worker.proto generates."""

from cluster.protocol.generate import GENERATED, PROTOCOL_DIR, generate


def test_generated_modules_match_the_proto(tmp_path):
    generate(tmp_path)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (PROTOCOL_DIR / name).read_text(), (
            f"{name} is stale: run `python -m cluster.protocol.generate`")
