"""Images through both APIs with the official clients: OpenAI ``image_url`` parts (base64 data URLs) and Anthropic
``image`` blocks, served by the tiny Qwen3-VL-MoE fixture; remote URLs refused unless allowed, limits, and a text
model saying it has no vision encoder."""

import base64
import functools
import io
import time

import anthropic
import httpx
import numpy as np
import openai
import PIL.Image
import pytest
from helpers.server import LLAMA, VL, VL_MODEL_NAME, make_engine, running_server, vl_model_folder, write_tokenizer

from serving.api import ipc
from serving.api.engine_core import model_info
from serving.api.engine_spec import EngineSpec
from serving.api.images import ImageOptions
from serving.api.process_engine import ModelInfo
from serving.api.server import Server, create_app
from serving.images import ImageProcessorConfig, expand_placeholders, preprocess

OPTIONS = ImageOptions(max_images=2, max_bytes=64 * 1024)
TEXT = "What is in the picture?"
READY_WITHIN_S = 240  # spawn, import jax, load the fixture, on 2 busy cores


@functools.cache
def raw_images() -> list[np.ndarray]:
    with np.load(VL / "reference.npz") as ref:
        return [ref["images_0"], ref["images_1"]]


def png(array: np.ndarray) -> str:
    """The image as base64 PNG (lossless: the server decodes the same pixels)."""
    out = io.BytesIO()
    PIL.Image.fromarray(array).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def data_url(array: np.ndarray) -> str:
    return f"data:image/png;base64,{png(array)}"


def openai_chat(url: str, *images: str, **kwargs):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": TEXT}]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=VL_MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                          max_tokens=8, temperature=0, **kwargs)


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    folder = vl_model_folder(tmp_path_factory.mktemp("models"))
    engine = make_engine(folder)
    with running_server(engine, VL_MODEL_NAME, image_options=OPTIONS) as (server, _):
        yield server, engine


def test_openai_image_url_parts(vl_server):
    server, engine = vl_server
    answer = openai_chat(server.url, data_url(raw_images()[0]))
    # The template's prompt with the image's one placeholder expanded to its 6 tokens.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    image = preprocess(PIL.Image.fromarray(raw_images()[0]), ImageProcessorConfig.from_folder(VL))
    assert answer.usage.prompt_tokens == len(expand_placeholders(ids, [image], engine.cfg.vision)) == len(ids) + 5
    assert answer.usage.completion_tokens == 8 and answer.choices[0].message.content
    again = openai_chat(server.url, data_url(raw_images()[0]))
    other = openai_chat(server.url, data_url(raw_images()[1]))
    assert again.choices[0].message.content == answer.choices[0].message.content
    assert other.choices[0].message.content != answer.choices[0].message.content, "the image is read"
    both = openai_chat(server.url, data_url(raw_images()[0]), data_url(raw_images()[1]), stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in both if chunk.choices)


def test_anthropic_image_blocks(vl_server):
    server, _ = vl_server
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png(raw_images()[0])}},
               {"type": "text", "text": TEXT}]
    message = client.messages.create(model=VL_MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": content}])
    answer = openai_chat(server.url, data_url(raw_images()[0]))
    assert message.usage.input_tokens == answer.usage.prompt_tokens  # the same template prompt
    assert message.content[0].text == answer.choices[0].message.content  # greedy: the same tokens
    counted = client.messages.count_tokens(model=VL_MODEL_NAME, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == message.usage.input_tokens
    with client.messages.stream(model=VL_MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": content}]) as stream:
        assert stream.get_final_message().content[0].text == message.content[0].text


def test_refusals(vl_server):
    server, _ = vl_server
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
        openai_chat(server.url, "https://example.com/cat.png")
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        openai_chat(server.url, "data:image/png;base64,@@@@")
    with pytest.raises(openai.BadRequestError, match="not an image Pillow can read"):
        openai_chat(server.url, "data:image/png;base64," + base64.b64encode(b"not an image").decode())
    with pytest.raises(openai.BadRequestError, match="media type 'text/plain'"):
        openai_chat(server.url, "data:text/plain;base64,aGk=")
    with pytest.raises(openai.APIStatusError, match="more than 2 images") as error:
        openai_chat(server.url, *[data_url(raw_images()[0])] * 3)
    assert error.value.status_code == 413
    noise = np.random.default_rng(0).integers(0, 256, size=(200, 200, 3), dtype=np.uint8)  # ~120 KB as PNG
    with pytest.raises(openai.APIStatusError, match="image of") as error:
        openai_chat(server.url, data_url(noise))
    assert error.value.status_code == 413
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="source type 'file'"):
        client.messages.create(model=VL_MODEL_NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "x"}}]}])


def test_a_text_model_says_it_has_no_vision_encoder(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    for file in LLAMA.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    write_tokenizer(folder)
    with running_server(make_engine(folder)) as (server, _):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="has no vision encoder: it reads text only"):
            client.chat.completions.create(model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(raw_images()[0])}}]}])
        anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="has no vision encoder"):
            anthropic_client.messages.create(model="tiny-llama", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": png(raw_images()[0])}}]}])


def test_images_and_the_model_cross_the_core_process_wire(vl_server):
    """What ``ProcessEngine`` sends the core (the images' patches) and gets back (the config with its encoder, the
    processor settings) comes through msgpack unchanged."""
    _, engine = vl_server
    processor = ImageProcessorConfig.from_folder(VL)
    images = [preprocess(PIL.Image.fromarray(x), processor) for x in raw_images()]
    back = ipc.images_from_wire(ipc.unpack(ipc.pack(ipc.images_to_wire(images))))
    for original, copy in zip(images, back, strict=True):
        np.testing.assert_array_equal(copy.pixels, original.pixels)
        assert (copy.grid, copy.digest) == (original.grid, original.digest)
    with pytest.raises(ValueError, match="bytes"):
        ipc.images_from_wire([[b"\0" * 12, [2, 2], [1, 2, 2], "x"]])
    info = ModelInfo()
    info.load(ipc.unpack(ipc.pack(model_info(engine))))
    assert info.cfg == engine.cfg and info.cfg.vision is not None
    assert info.image_processor == engine.image_processor == processor


@pytest.mark.slow
def test_images_through_the_engine_core_process(vl_server, tmp_path):
    """The default server (engine in its own process): the same greedy answer as the in-process engine's."""
    server, _ = vl_server
    expected = openai_chat(server.url, data_url(raw_images()[1])).choices[0].message.content
    spec = EngineSpec(str(vl_model_folder(tmp_path)), dtype="float32", num_blocks=512, block_size=4, max_running=8,
                      token_budget=64, max_model_len=1024)
    with Server(create_app(spec, VL_MODEL_NAME, image_options=OPTIONS)) as process_server:
        deadline = time.monotonic() + READY_WITHIN_S
        while httpx.get(f"{process_server.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine core did not get ready"
            time.sleep(0.2)
        answer = openai_chat(process_server.url, data_url(raw_images()[1]))
        assert answer.choices[0].message.content == expected
        with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
            openai_chat(process_server.url, "http://127.0.0.1:1/cat.png")
