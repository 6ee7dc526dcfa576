"""The router loads a model folder's fast tokenizer without AutoTokenizer (whose module imports
torch) only where AutoTokenizer would give the same class, and then the same token ids."""

import json
import subprocess
import sys

from router.flow.tokenization import load_tokenizer
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
