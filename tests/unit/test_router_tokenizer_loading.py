"""The router loads a model folder's fast tokenizer without AutoTokenizer (whose module imports
torch) only where AutoTokenizer would give the same class, and then the same token ids."""

import copy
import json
import subprocess
import sys

from transformers.tokenization_utils_tokenizers import TokenizersBackend

from router.flow.tokenization import fast_encode, load_tokenizer
from tests.integration.prompts import CHATS, PROMPTS, long_prompt

TEXTS = [*PROMPTS, long_prompt(200), "日本語 é <|im_start|> \n\t  spaces", ""]


def test_a_tokenizersbackend_folder_gives_autotokenizers_ids(smollm2_dir):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(str(smollm2_dir)), AutoTokenizer.from_pretrained(smollm2_dir)
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special
            )
    for chat in CHATS:
        assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
            chat, tokenize=False
        )


def test_loading_it_imports_no_torch(smollm2_dir):
    probe = (
        "import sys; from router.flow.tokenization import load_tokenizer; "
        f"load_tokenizer({str(smollm2_dir)!r}); print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"


def test_a_folder_naming_another_class_goes_through_autotokenizer(
    smollm2_dir, tmp_path, monkeypatch
):
    import transformers

    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    settings = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    asked = []
    fake_auto = lambda model: asked.append(model) or "from AutoTokenizer"  # noqa: E731
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_auto)
    for changed in ({"tokenizer_class": "GPT2Tokenizer"}, {"auto_map": {"AutoTokenizer": "x"}}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, **changed}))
        assert load_tokenizer(str(tmp_path)) == "from AutoTokenizer"
    assert load_tokenizer("HuggingFaceTB/SmolLM2-135M") == "from AutoTokenizer"  # a hub id
    assert asked == [str(tmp_path), str(tmp_path), "HuggingFaceTB/SmolLM2-135M"]


def test_the_routers_own_encode_gives_transformers_ids(smollm2_dir, tmp_path):
    """The Rust tokenizer called directly (router/flow/tokenization.py's fast_encode) against
    transformers' encode, on SmolLM2's tokenizer made harder: its tokenizer.json adds a BOS with
    its post processor (so add_special_tokens matters) and carries a truncation and a padding
    section (which transformers' encode turns off for a call with no truncation)."""
    variant = json.loads((smollm2_dir / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    variant["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    variant["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    variant["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 2,
        "pad_type_id": 0,
        "pad_token": "<|im_end|>",
    }
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_dir / name).exists():
            (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "tokenizer.json").write_text(json.dumps(variant))
    reference = load_tokenizer(str(tmp_path))
    encode = fast_encode(copy.deepcopy(reference))
    assert encode is not None
    for text in TEXTS:
        for special in (True, False):
            expected = reference.encode(text, add_special_tokens=special)
            assert encode(text, special) == expected, (text, special)
            assert expected[:1] == [1] or not special  # the BOS was there to be matched

    class Custom(TokenizersBackend):  # encodes its own way: never bypassed by the direct call
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    reference.__class__ = Custom
    assert fast_encode(reference) is None
