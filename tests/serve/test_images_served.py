"""`hf-paged serve` of a vision-language model folder (tiny LLaVA and its processor): chat messages with
base64 `image_url` parts, through the openai client, streamed and not, equal stock `generate` on the
processor's own rendering; anything but a readable data URL is a 400 and fetches nothing."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch

from served import Served
from tiny_models import tiny_llava_processor, tiny_vlm

pytest.importorskip("openai")


def _png(seed: int) -> tuple[bytes, object]:
    from PIL import Image

    image = Image.fromarray((np.random.RandomState(seed).rand(40, 48, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), image


def _part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm")
    tiny_vlm("llava").save_pretrained(path)
    tiny_llava_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(vlm_dir):
    s = Served(vlm_dir)
    yield s
    s.stop()


def _stock_text(vlm_dir, image, text: str, max_tokens: int) -> str:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, attn_implementation="sdpa").eval()
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_with_an_image_equals_stock_streamed_and_not(server, vlm_dir):
    client = server.client()
    texts = []
    for seed in (0, 1):
        png, image = _png(seed)
        messages = [{"role": "user", "content": [_part(png), {"type": "text", "text": "w5 w6 w7"}]}]
        want = _stock_text(vlm_dir, image, "w5 w6 w7", 8)
        got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        # Word-level tokens ("w<id>"): equal word lists are equal token ids (the tokenizer has no decoder,
        # so where a space goes is its own affair).
        assert got.choices[0].message.content.split() == want.split() and len(want.split()) == 8
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).split() == want.split()
        texts.append(want)
    assert texts[0] != texts[1]  # the answer depends on the image


@pytest.mark.parametrize("part, match", [
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}, "fetches nothing"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "malformed"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
     "no image this server can read"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "'text' or 'image_url'"),
])
def test_bad_image_parts_get_400(server, part, match):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [part, {"type": "text",
                                                                                            "text": "w5"}]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=30)
    assert r.status_code == 400 and match in r.json()["error"]["message"]


def test_text_parts_alone_and_the_server_keeps_serving(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": "w5"}]}]})
    assert r.status_code == 200
