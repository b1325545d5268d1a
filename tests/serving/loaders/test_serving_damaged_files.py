"""A damaged file in a checkpoint folder is a ValueError that names the file: config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, the safetensors index and the weights themselves, each cut short or not
JSON. Before, a bad config.json was a bare JSONDecodeError (a list one an AttributeError), a bad tokenizer.json a
bare ``Exception("expected value at line 1 column 1")`` and a truncated .safetensors a SafetensorError, none of them
saying which file."""

import json
import re
import shutil

import jax.numpy as jnp
import pytest
from helpers import HF
from helpers.server import model_folder

from serving.json_files import read_json
from serving.loaders import load_model
from serving.tokenizer import Tokenizer


def cut_in_half(file):
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


DAMAGE = {  # file -> what is done to it
    "config.json": lambda f: f.write_text('{"model_type": "llama",'),
    "generation_config.json": lambda f: f.write_text("[2]"),
    "tokenizer.json": cut_in_half,
    "tokenizer_config.json": lambda f: f.write_text("{'bos_token': '<s>'}"),
    "model.safetensors": cut_in_half,
}


@pytest.mark.parametrize("name", DAMAGE)
def test_a_damaged_file_of_a_folder_is_a_value_error_naming_it(tmp_path, name):
    folder = model_folder(tmp_path)
    if name == "generation_config.json":  # read for its eos ids where the folder has no tokenizer
        (folder / "tokenizer.json").unlink()
    DAMAGE[name](folder / name)
    with pytest.raises(ValueError, match=re.escape(str(folder / name))):
        load_model(folder, jnp.float32)


def test_a_damaged_shard_index_is_a_value_error_naming_it(tmp_path):
    folder = tmp_path / "deepseek_v3"
    shutil.copytree(HF / "deepseek_v3", folder)
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-10])
    with pytest.raises(ValueError, match=re.escape(f"{index}: not valid JSON (")):
        load_model(folder, jnp.float32)


def test_read_json_says_what_is_wrong_and_where(tmp_path):
    file = tmp_path / "x.json"
    with pytest.raises(FileNotFoundError):
        read_json(file)
    assert read_json(file, missing={}) == {}
    file.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ValueError, match=re.escape(f"{file}: not valid JSON (Expecting value at line 2, column 7)")):
        read_json(file)
    file.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=re.escape(f"{file}: not UTF-8 text (invalid start byte at byte 7)")):
        read_json(file)
    file.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match=re.escape(f"{file} holds a JSON list: expected an object")):
        read_json(file, missing={})
    file.write_text(json.dumps({"a": [1]}))
    assert read_json(file) == {"a": [1]}


def test_a_tokenizer_file_that_tokenizers_cannot_read_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'tokenizer.json'}: not a tokenizers file (")):
        Tokenizer.from_hf_folder(tmp_path)
