"""Vision-language requests through the engine (`hf.multimodal`): each request's images encoded once per
distinct image, placed at its placeholders, hashed into its blocks; greedy tokens equal stock
`generate` per request (tiny LLaVA and Mistral 3, random weights)."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tiny_models import IMAGE_TOKEN, tiny_images, tiny_vlm

NEW = 6
PER_IMAGE = 16  # the tiny LLaVA's placeholders per 32x32 image


@pytest.fixture(scope="module")
def llava():
    stock = tiny_vlm("llava")
    ours = tiny_vlm("llava", "hf_paged")
    return stock, ours


def _stock_tokens(stock, ids: list[int], pixels: torch.Tensor | None, **image_kwargs) -> list[int]:
    kwargs = {} if pixels is None else {"pixel_values": pixels, **image_kwargs}
    out = stock.generate(input_ids=torch.tensor([ids]), **kwargs, max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False)
    return out[0, len(ids):].tolist()


def _prompt(head: list[int], num_images: int, tail: list[int], per_image: int = PER_IMAGE) -> list[int]:
    ids = [1] + head
    for _ in range(num_images):
        ids += [IMAGE_TOKEN] * per_image + [3]
    return ids + tail


HEAD_A, HEAD_B = [5, 6, 7], [9, 10, 11, 12, 13]
TAIL = list(range(20, 34))


class _Family:
    """How one VLM family's tiny model takes images: its prompt layout, its processor outputs per image,
    and the extra keywords stock `generate` gets (what the family's processor would return)."""

    def __init__(self, name: str):
        import tiny_models as tm

        self.name = name
        if name == "llava":
            self.build = lambda attn: tm.tiny_vlm("llava", attn)
            images = tiny_images(4, seed=10)
            self.items = [{"pixel_values": images[i:i + 1]} for i in range(4)]
            self.open, self.per_image, self.close = [], PER_IMAGE, [3]
        elif name == "qwen2_vl":
            self.build = lambda attn: tm.tiny_qwen2_vl(attn)
            self.items = [tm.qwen2_vl_image(8, 8, seed=10 + i) for i in range(4)]  # 16 placeholders each
            self.open, self.per_image, self.close = [tm.VOCAB - 3], 16, [tm.VOCAB - 4]
        else:  # gemma3: the placeholders of one image attend to each other both ways
            self.build = lambda attn: tm.tiny_gemma3_vlm("eager" if attn == "sdpa" else attn)
            images = tiny_images(4, seed=10)
            self.items = [{"pixel_values": images[i:i + 1]} for i in range(4)]
            self.open, self.per_image, self.close = [tm.VOCAB - 3], 16, [tm.VOCAB - 4]

    def prompt(self, head: list[int], idx: list[int], tail: list[int]) -> list[int]:
        ids = [1] + head
        for _ in idx:
            ids += self.open + [IMAGE_TOKEN] * self.per_image + self.close
        return ids + tail

    def data(self, idx: list[int]) -> dict:
        return {k: torch.cat([self.items[i][k] for i in idx]) for k in self.items[0]}

    def stock_kwargs(self, ids: torch.Tensor, idx: list[int]) -> dict:
        if not idx:
            return {}
        extra = {"qwen2_vl": {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()},
                 "gemma3": {"token_type_ids": (ids == IMAGE_TOKEN).long()}}.get(self.name, {})
        return {**self.data(idx), **extra}

    def check_against_stock(self, stock, engine: Engine, requests: list) -> list:
        """Run `requests` ((ids, image indices) pairs) in `engine`; each one's greedy tokens must equal
        stock's and its first-step logits be within 1e-5 (fp32: about 1e-6 apart; a causal mask over
        Gemma 3's images is ~1e-1 off in this tiny model). Returns the outputs."""
        prompts = [{"prompt_token_ids": ids, "multi_modal_data": self.data(idx)} if idx else ids
                   for ids, idx in requests]
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, output_logits=True))
        for (ids, idx), out in zip(requests, outputs):
            t = torch.tensor([ids])
            want = stock.generate(input_ids=t, **self.stock_kwargs(t, idx), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
            assert out.outputs[0].token_ids == want.sequences[0, len(ids):].tolist()
            torch.testing.assert_close(out.outputs[0].logits[0], want.logits[0][0], atol=1e-5, rtol=1e-5)
        return outputs


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_sixteen_requests_mixing_four_images_and_text_match_stock(family):
    fam = _Family(family)
    stock, ours = fam.build("sdpa"), fam.build("hf_paged")
    requests = []  # (prompt ids, image indices)
    for i in range(4):  # each image three times: two texts, one repeated exactly
        requests += [(fam.prompt(HEAD_A, [i], TAIL), [i]), (fam.prompt(HEAD_B, [i], TAIL), [i]),
                     (fam.prompt(HEAD_A, [i], TAIL), [i])]
    requests += [(fam.prompt(HEAD_A, [], TAIL), []), (fam.prompt(HEAD_B, [], TAIL), []),
                 (fam.prompt(HEAD_A, [], TAIL), [])]
    requests.append((fam.prompt(HEAD_B, [2, 3], TAIL), [2, 3]))  # two images in one prompt, in order
    assert len(requests) == 16
    engine = Engine(ours, max_num_seqs=4, num_blocks=64)  # four at a time: later ones find earlier blocks
    outputs = fam.check_against_stock(stock, engine, requests)
    # Images A and B behind the same placeholders must give different answers.
    a, b = outputs[0].outputs[0].logits[0], outputs[3].outputs[0].logits[0]
    assert (a - b).abs().max() > 1e-3
    metrics = engine.metrics()
    assert metrics["mm_encoder_runs"] == 4  # once per distinct image
    assert metrics["vllm:mm_cache_queries"] == 14 and metrics["vllm:mm_cache_hits"] == 10
    assert metrics["mm_prefix_cache_hits"] >= 8  # repeated (text, image) pairs reuse the blocks of their images


def test_different_images_behind_the_same_placeholders_never_share_blocks(llava):
    stock, ours = llava
    images = tiny_images(2, seed=1)
    ids = _prompt(HEAD_A, 1, TAIL)
    engine = Engine(ours, max_num_seqs=1, num_blocks=32)  # one at a time: the second could find the first's blocks
    outs = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"pixel_values": images[i:i + 1]}}
                            for i in (0, 1, 0)], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [_stock_tokens(stock, ids, images[i:i + 1]) for i in (0, 1, 0)]
    # Block 1 holds only placeholders (tokens 16..31): B may not take A's; the second A does.
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 32]


def test_chunked_prefill_splits_an_image_and_preemption_recomputes_it(llava):
    stock, ours = llava
    images = tiny_images(3, seed=2)
    requests = [(_prompt(HEAD_A, 2, TAIL), [0, 1]), (_prompt(HEAD_B, 1, TAIL), [2]), (_prompt(HEAD_A, 1, TAIL), [1])]
    engine = Engine(ours, max_num_seqs=3, max_num_batched_tokens=8, num_blocks=5)  # chunks of 8; a tight pool
    outs = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"pixel_values": images[idx]}}
                            for ids, idx in requests], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [_stock_tokens(stock, ids, images[idx]) for ids, idx in requests]
    assert engine.metrics()["vllm:num_preemptions"] > 0


def test_drop_in_generate_with_pixel_values_runs_in_the_engine(llava):
    stock, ours = llava
    images = tiny_images(3, seed=3)
    rows = [_prompt(HEAD_A, 1, TAIL), _prompt(HEAD_B, 2, TAIL[:5]), _prompt(HEAD_A, 0, TAIL[:3]),
            _prompt(HEAD_A, 1, TAIL)]
    pixels = torch.cat([images[0:1], images[1:3], images[0:1]])  # in row order, as a processor gives them
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kwargs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=NEW, do_sample=False,
                  pad_token_id=0)
    want = stock.generate(**kwargs)
    ours.hf_paged_last_metrics = None
    got = ours.generate(**kwargs)
    assert torch.equal(got, want)
    metrics = ours.hf_paged_last_metrics
    assert metrics is not None and metrics["num_steps"] > 0  # the engine ran it
    assert metrics["mm_encoder_runs"] == 3 and metrics["mm_prefix_cache_hits"] >= PER_IMAGE


def test_mistral3_images_of_different_sizes_match_stock():
    stock, ours = tiny_vlm("mistral3"), tiny_vlm("mistral3", "hf_paged")
    pixels = tiny_images(3, size=48, seed=4)
    sizes = torch.tensor([[32, 32], [48, 32], [48, 48]])  # 4, 6 and 9 placeholders
    rows = [_prompt(HEAD_A, 1, TAIL, 4), _prompt(HEAD_B, 1, TAIL, 6) + _prompt([], 1, [], 9)[1:],
            _prompt(HEAD_A, 0, TAIL)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kwargs = dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_sizes=sizes, max_new_tokens=NEW,
                  do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want = stock.generate(**kwargs)
    engine = Engine(ours)
    prompts = [{"prompt_token_ids": rows[0], "multi_modal_data": {"pixel_values": pixels[:1], "image_sizes": sizes[:1]}},
               {"prompt_token_ids": rows[1], "multi_modal_data": {"pixel_values": pixels[1:], "image_sizes": sizes[1:]}},
               rows[2]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True, output_logits=True))
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == want.sequences[i, width:].tolist()
        first = torch.stack([step[i] for step in want.logits])[0]
        torch.testing.assert_close(out.outputs[0].logits[0], first, atol=1e-4, rtol=1e-4)  # fp32


def test_a_request_whose_images_do_not_fit_its_placeholders_fails_alone(llava):
    _, ours = llava
    images = tiny_images(2, seed=5)
    engine = Engine(ours, num_blocks=32)
    good = {"prompt_token_ids": _prompt(HEAD_A, 1, TAIL), "multi_modal_data": {"pixel_values": images[:1]}}
    bad = {"prompt_token_ids": _prompt(HEAD_A, 1, TAIL), "multi_modal_data": {"pixel_values": images}}  # 2 images, 1 run
    outs = engine.generate([good, bad, _prompt(HEAD_B, 0, TAIL)], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert "16 image placeholder tokens" in str(outs[1].outputs[0].error)
    assert "give 32 feature rows" in str(outs[1].outputs[0].error)


@pytest.mark.parametrize("prompt, error, match", [
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"pixel_values": torch.zeros(1, 3, 32, 32), "foo": 1}},
     ValueError, "does not take"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, ValueError, "needs pixel_values"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"pixel_values": torch.zeros(1, 3, 32, 32, dtype=torch.long)}},
     TypeError, "floating point"),
    ({"prompt_token_ids": [1, 2], "prompt": "x"}, ValueError, "exactly one of"),
    ({"prompt_token_ids": [1, 2], "images": []}, ValueError, "takes 'prompt' or 'prompt_token_ids'"),
])
def test_malformed_image_requests_are_refused_at_once(llava, prompt, error, match):
    _, ours = llava
    engine = Engine(ours, num_blocks=8)
    with pytest.raises(error, match=match):
        engine.add_request(prompt)
    assert not engine.has_unfinished_requests()


def test_a_text_only_model_refuses_images():
    from tiny_models import tiny_model

    engine = Engine(tiny_model("llama", "hf_paged"), num_blocks=8)
    with pytest.raises(ValueError, match="takes no images"):
        engine.add_request({"prompt_token_ids": [1, 2], "multi_modal_data": {"pixel_values": torch.zeros(1, 3, 8, 8)}})


def _pil_images(num: int, seed: int = 0) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(40, 48, 3) * 255).astype("uint8")) for _ in range(num)]


def test_image_text_to_text_pipeline_runs_in_the_engine(llava):
    from transformers import pipeline

    from tiny_models import tiny_llava_processor

    stock, ours = llava
    processor = tiny_llava_processor()
    a, b = _pil_images(2)
    call = dict(images=[a, b, a], text=["<image> w5 w6 w7", "w9 <image> w10", "<image> w5 w6 w7"],
                generate_kwargs={"max_new_tokens": NEW, "do_sample": False}, batch_size=3)
    want = pipeline("image-text-to-text", model=stock, processor=processor)(**call)
    ours.hf_paged_last_metrics = None
    got = pipeline("image-text-to-text", model=ours, processor=processor)(**call)
    assert got == want
    assert ours.hf_paged_last_metrics["num_steps"] > 0 and ours.hf_paged_last_metrics["mm_prefix_cache_hits"] > 0


def test_a_vlm_call_returns_a_returned_cache_that_stock_generate_continues(llava):
    from hf_paged.integrations.returned_cache import ReturnedCache
    from tiny_models import CACHE_KEY, tiny_llava_processor

    stock, ours = llava
    processor = tiny_llava_processor()
    images = _pil_images(2, seed=1)
    inputs = processor(text=["<image> w5 w6 w7", "w9 w8 <image> w10"], images=images, return_tensors="pt",
                       padding=True, padding_side="left")
    first = {**inputs, "max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True}
    want, got = stock.generate(**first), ours.generate(**first)
    assert torch.equal(got.sequences, want.sequences)
    assert isinstance(getattr(got, CACHE_KEY), ReturnedCache)
    more = torch.full((2, 2), 7)
    second = {"input_ids": torch.cat([want.sequences, more], 1),  # the images are in the cache already
              "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, NEW + 2, dtype=torch.long)], 1),
              "max_new_tokens": NEW, "do_sample": False}
    assert torch.equal(ours.generate(**second, **{CACHE_KEY: getattr(got, CACHE_KEY)}),
                       stock.generate(**second, **{CACHE_KEY: getattr(want, CACHE_KEY)}))


# ---------------------------------------------------------------------------------- Qwen2-VL (M-RoPE)
def _qwen_prompt(head: list[int], grids: list[tuple[int, int]], tail: list[int]) -> list[int]:
    from tiny_models import VOCAB

    ids = [1] + head
    for h, w in grids:  # vision start, the image's merged patches, vision end
        ids += [VOCAB - 3] + [IMAGE_TOKEN] * (h * w // 4) + [VOCAB - 4]
    return ids + tail


def _qwen_images(images: list[dict], idx: list[int]) -> dict:
    return {k: torch.cat([images[i][k] for i in idx]) for k in ("pixel_values", "image_grid_thw")}


@pytest.fixture(scope="module")
def qwen2_vl():
    from tiny_models import tiny_qwen2_vl

    return tiny_qwen2_vl(), tiny_qwen2_vl("hf_paged")


def test_qwen2_vl_three_d_positions_match_stock_through_chunks_and_the_prefix_cache(qwen2_vl):
    from tiny_models import qwen2_vl_image

    stock, ours = qwen2_vl
    images = [qwen2_vl_image(4, 4, 0), qwen2_vl_image(4, 6, 1), qwen2_vl_image(6, 8, 2)]
    tail = list(range(20, 40))
    requests = [(_qwen_prompt([5, 6], [(4, 4)], tail), [0]), (_qwen_prompt([5, 6], [(4, 6)], tail), [1]),
                (_qwen_prompt([7], [(4, 4), (6, 8)], [9, 9]), [0, 2]), (_qwen_prompt([5, 6], [], tail), []),
                (_qwen_prompt([5, 6], [(4, 4)], tail), [0])]
    engine = Engine(ours, max_num_seqs=2, max_num_batched_tokens=8, num_blocks=32)  # 8-token chunks split images
    outs = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": _qwen_images(images, idx)} if idx else ids
                            for ids, idx in requests], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for (ids, idx), out in zip(requests, outs):
        t = torch.tensor([ids])
        extra = {**_qwen_images(images, idx), "mm_token_type_ids": (t == IMAGE_TOKEN).int()} if idx else {}
        want = stock.generate(input_ids=t, **extra, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(ids):].tolist()
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    metrics = engine.metrics()
    assert metrics["mm_encoder_runs"] == 3 and metrics["mm_prefix_cache_hits"] > 0


def test_qwen2_vl_drop_in_generate_with_a_padded_batch(qwen2_vl):
    from tiny_models import qwen2_vl_image

    stock, ours = qwen2_vl
    images = [qwen2_vl_image(4, 4, 3), qwen2_vl_image(6, 4, 4)]
    rows = [_qwen_prompt([5], [(4, 4)], [8, 9, 10, 11]), _qwen_prompt([6, 7, 8], [(6, 4), (4, 4)], [12]),
            _qwen_prompt([9], [], [13, 14])]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kwargs = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE_TOKEN).int(),
                  **_qwen_images(images, [0, 1, 0]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = stock.generate(**kwargs)
    ours.hf_paged_last_metrics = None
    assert torch.equal(ours.generate(**kwargs), want)
    assert ours.hf_paged_last_metrics["num_steps"] > 0


# ---------------------------------------------------------------------------------- Gemma 3 (bidirectional images)
@pytest.fixture(scope="module")
def gemma3():
    return _Family("gemma3")


def test_gemma3_images_stay_whole_in_small_chunks_and_attend_both_ways(gemma3):
    stock, ours = gemma3.build("sdpa"), gemma3.build("hf_paged")
    requests = [(gemma3.prompt(HEAD_A, [0], TAIL), [0]), (gemma3.prompt([7], [1, 2], [9]), [1, 2]),
                (gemma3.prompt(HEAD_B, [], TAIL), [])]
    # 20-token chunks: an image (16 placeholders between its markers) never fits after the text before it,
    # so every chunk that reaches one is cut at its start.
    gemma3.check_against_stock(stock, Engine(ours, max_num_seqs=2, max_num_batched_tokens=20, num_blocks=32), requests)
    too_small = Engine(ours, max_num_batched_tokens=12, num_blocks=32)
    out = too_small.generate([{"prompt_token_ids": requests[0][0], "multi_modal_data": gemma3.data([0])}],
                             SamplingParams(max_new_tokens=2))[0]
    assert out.outputs[0].finish_reason == "error" and "max_num_batched_tokens is 12" in str(out.outputs[0].error)


def test_gemma3_drop_in_generate_follows_stock_with_and_without_token_types(gemma3):
    from hf_paged.integrations.returned_cache import ReturnedCache
    from tiny_models import CACHE_KEY

    stock, ours = gemma3.build("sdpa"), gemma3.build("hf_paged")
    rows = [gemma3.prompt(HEAD_A, [0], TAIL[:4]), gemma3.prompt([7], [1, 0], [9]), gemma3.prompt(HEAD_B, [], [4])]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    base = dict(input_ids=ids, attention_mask=mask, **gemma3.data([0, 1, 0]), max_new_tokens=NEW, do_sample=False,
                pad_token_id=0, return_dict_in_generate=True)
    typed = {**base, "token_type_ids": (ids == IMAGE_TOKEN).long()}
    want = stock.generate(**typed)
    ours.hf_paged_last_metrics = None
    got = ours.generate(**typed)
    assert torch.equal(got.sequences, want.sequences) and ours.hf_paged_last_metrics["num_steps"] > 0
    assert isinstance(getattr(got, CACHE_KEY), ReturnedCache)
    more = {"input_ids": torch.cat([want.sequences, torch.full((3, 2), 7)], 1), "max_new_tokens": NEW,
            "attention_mask": torch.cat([mask, torch.ones(3, NEW + 2, dtype=torch.long)], 1), "do_sample": False,
            "pad_token_id": 0}
    assert torch.equal(ours.generate(**more, **{CACHE_KEY: getattr(got, CACHE_KEY)}),  # dense, bidirectional images
                       stock.generate(**more, **{CACHE_KEY: getattr(want, CACHE_KEY)}))
    # Without token types stock attends causally over the images: stock serves the call, so equal again.
    ours.hf_paged_last_metrics = None
    assert torch.equal(ours.generate(**base).sequences, stock.generate(**base).sequences)
    assert ours.hf_paged_last_metrics is None
