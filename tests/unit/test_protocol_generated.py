"""The committed gRPC modules are exactly what their .proto files generate."""

import pytest

from pdserve.protocol.generate import PROTOS, generate, generated_names


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_generated_modules_match_the_proto(proto, tmp_path):
    generate(proto, tmp_path)
    for name in generated_names(proto):
        assert (tmp_path / name).read_text() == (proto.parent / name).read_text(), (
            f"{name} is stale: run `python -m pdserve.protocol.generate`"
        )
