"""A locally built Hugging Face-format directory loads in transformers and in this project."""

import json

import pytest

torch = pytest.importorskip("torch", reason="the checkpoint's weights need torch")
transformers = pytest.importorskip("transformers", reason="transformers is the loader's oracle")

from hardware.model.config import tiny_config  # noqa: E402
from hardware.model.hf_dir import build_checkpoint, vocabulary  # noqa: E402
from hardware.model.llama import LlamaModel  # noqa: E402


def test_the_vocabulary_is_the_specials_then_one_word_per_id():
    words = vocabulary(8)
    assert words == {"<unk>": 0, "<s>": 1, "</s>": 2, "w3": 3, "w4": 4, "w5": 5, "w6": 6,
                     "w7": 7}
    with pytest.raises(ValueError, match="vocab_size 3 must exceed"):
        vocabulary(3)


def test_the_directory_loads_in_transformers_and_here(tmp_path):
    path = build_checkpoint(tmp_path / "tiny", seed=3, dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok("w5 w1000 nonsense w7")["input_ids"] == [5, 1000, 0, 7]
    assert tok.decode([5, 6]) == "w5 w6"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == tiny_config().vocab_size and config["eos_token_id"] == 2
    ours = LlamaModel.load(path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[5, 9, 300, 7]])
    with torch.no_grad():
        expected = theirs(ids).logits.float()                                   # [1, 4, V]
    torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
