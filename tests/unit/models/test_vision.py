"""The tiny vision policy: the placeholder contract, engine behavior log-probs equal the trainer's recompute with
images (batched, across pause/resume and weight pushes), banned image tokens, and the saved folder."""

import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM

from flashreinforce.models import build_char_tokenizer, build_model, load_model, token_logprobs
from flashreinforce.models.image_tokens import IMAGE_TOKEN, expand_image_placeholders
from flashreinforce.models.vision import VisionConfig, build_vision_lm
from flashreinforce.rollout.engine import Engine
from engine_rows import max_logprob_gap, recompute, rows_of, run_to_end
from flashreinforce.types import SamplingParams

TOKENIZER = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz: 0123456789",
                                 special_tokens=("<pad>", "<eos>", "<unk>", IMAGE_TOKEN))
IMAGE_ID = TOKENIZER.convert_tokens_to_ids(IMAGE_TOKEN)


def png(seed: int, size: int = 64) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def vision_model(seed: int = 0):
    lm = build_model(len(TOKENIZER), 64, 2, 4, 128, pad_token_id=0, eos_token_id=1, seed=seed)
    return build_vision_lm(lm, VisionConfig(image_token_id=IMAGE_ID), seed=seed)


def prompt_ids(model, text: str, images: list[bytes]) -> list[int]:
    return model.placeholders.expand(TOKENIZER.encode(text, add_special_tokens=False), images)


def test_placeholders_expand_once_to_each_images_run():
    ids = TOKENIZER.encode(f"a{IMAGE_TOKEN}b{IMAGE_TOKEN}c", add_special_tokens=False)
    expanded = expand_image_placeholders(ids, IMAGE_ID, [2, 3])
    assert expanded == [ids[0], IMAGE_ID, IMAGE_ID, ids[2], IMAGE_ID, IMAGE_ID, IMAGE_ID, ids[4]]
    with pytest.raises(ValueError, match="expanded already"):  # TRL #6294: expanding twice
        expand_image_placeholders(expanded, IMAGE_ID, [2, 3])
    with pytest.raises(ValueError, match="2 <image> placeholders for 1 images"):
        expand_image_placeholders(ids, IMAGE_ID, [2])
    with pytest.raises(ValueError, match="1 <image> placeholders for 0 images"):  # a literal <image>, no image
        expand_image_placeholders(TOKENIZER.encode(f"x{IMAGE_TOKEN}", add_special_tokens=False), IMAGE_ID, [])


def test_engine_behavior_logprobs_equal_the_recompute_with_images():
    torch.manual_seed(0)
    model = vision_model()
    engine = Engine(copy.deepcopy(model), max_batch_size=3, max_context=100, eos_token_ids=1, pad_token_id=0)
    for i in range(7):  # more requests than slots: images prefill as rows join a running batch
        images = [png(i)] if i % 3 else [png(i), png(100 + i)]
        text = f"{IMAGE_TOKEN}count red:" if len(images) == 1 else f"{IMAGE_TOKEN}or{IMAGE_TOKEN}which:"
        engine.submit(f"r{i}", prompt_ids(model, text, images), SamplingParams(max_new_tokens=10, seed=i),
                      images=images)
    generations = run_to_end(engine)
    assert len(generations) == 7 and all(g.images for g in generations)
    assert max_logprob_gap(model, generations) <= 1e-5
    ids, mask = rows_of(generations)
    with torch.no_grad():  # the images matter: other pixels give other log-probs
        own, _ = token_logprobs(model, ids, mask, images=[g.images for g in generations])
        other, _ = token_logprobs(model, ids, mask, images=[tuple(png(999) for _ in g.images) for g in generations])
    assert float((own - other).abs().max()) > 1e-3


def test_two_images_side_by_side_are_two_placeholders_and_each_one_is_seen():
    """`<image><image>` in data: two adjacent placeholders, each its own image's run (not refused as re-expanded)."""
    ids = TOKENIZER.encode(f"{IMAGE_TOKEN}{IMAGE_TOKEN}which:", add_special_tokens=False)
    assert ids[:2] == [IMAGE_ID, IMAGE_ID]
    assert expand_image_placeholders(ids, IMAGE_ID, [2, 3])[:6] == [IMAGE_ID] * 5 + [ids[2]]
    model = vision_model()
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=100, eos_token_ids=1, pad_token_id=0)
    pairs = [(png(1), png(2)), (png(2), png(1))]  # the same two pictures in either order
    for i, images in enumerate(pairs):
        engine.submit(f"r{i}", prompt_ids(model, f"{IMAGE_TOKEN}{IMAGE_TOKEN}which:", list(images)),
                      SamplingParams(max_new_tokens=6, seed=0), images=images)
    generations = sorted(run_to_end(engine), key=lambda g: g.request_id)
    assert max_logprob_gap(model, generations) <= 1e-5
    ids, mask = rows_of(generations[:1])
    with torch.no_grad():  # order matters: each placeholder takes its own image
        forward, _ = token_logprobs(model, ids, mask, images=[pairs[0]])
        swapped, _ = token_logprobs(model, ids, mask, images=[pairs[1]])
    assert float((forward - swapped).abs().max()) > 1e-3


def test_images_survive_pause_resume_and_a_weight_push():
    model = vision_model()
    engine = Engine(copy.deepcopy(model), max_batch_size=4, max_context=100, eos_token_ids=(), pad_token_id=0)
    for i in range(4):
        engine.submit(f"r{i}", prompt_ids(model, f"{IMAGE_TOKEN}count:", [png(i)]),
                      SamplingParams(max_new_tokens=12, seed=i), images=[png(i)])
    for _ in range(3):
        engine.step()
    partials = engine.pause()
    assert [p.images for p in partials] == [(png(i),) for i in range(4)]
    new = vision_model(seed=7)  # the next version's weights, vision included
    engine.load_weights(new.state_dict(), version=1)
    for partial in partials:  # the prefix brings its images back
        engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)
    generations = run_to_end(engine)
    # Resumed rows re-read their prompt and prefix under the new weights: each token's behavior log-prob is its
    # own version's; the tokens after the resume are version 1's, and match version 1's recompute.
    recomputed = recompute(new, generations)
    for row, g in enumerate(generations):
        start = len(g.prompt_ids)
        late = [j for j, v in enumerate(g.policy_versions) if v == 1]
        assert len(late) == 9
        gap = (recomputed[row, [start + j for j in late]] - torch.tensor([g.behavior_logprobs[j] for j in late]))
        assert float(gap.abs().max()) <= 1e-5


def test_image_tokens_are_never_sampled_and_the_recompute_bans_them_too():
    model = vision_model()
    with torch.no_grad():  # make the LM prefer the image token everywhere (tied embeddings: its output row)
        model.language_model.get_input_embeddings().weight[IMAGE_ID] *= 50
    engine = Engine(copy.deepcopy(model), max_batch_size=8, max_context=100, eos_token_ids=(), pad_token_id=0)
    for i in range(8):
        engine.submit(f"r{i}", prompt_ids(model, f"{IMAGE_TOKEN}x", [png(i)]),
                      SamplingParams(max_new_tokens=20, seed=i), images=[png(i)])
    generations = run_to_end(engine)
    assert not any(IMAGE_ID in g.token_ids for g in generations)
    assert max_logprob_gap(model, generations) <= 1e-5  # both sides describe the banned distribution
    ids, mask = rows_of(generations)
    recomputed, entropies = token_logprobs(model, ids, mask, images=[g.images for g in generations])
    assert bool(torch.isfinite(recomputed).all()) and bool(torch.isfinite(entropies).all())
    recomputed.sum().backward()  # prompt image tokens carry log-prob 0, and no NaN reaches a gradient
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    assert model.vision.patchify.weight.grad.abs().sum() > 0  # gradients reach the encoder


def test_requests_whose_images_and_ids_disagree_are_refused():
    model = vision_model()
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=100, eos_token_ids=1, pad_token_id=0)
    ids = prompt_ids(model, f"{IMAGE_TOKEN}count:", [png(0)])
    with pytest.raises(ValueError, match="its 0 images need 0"):
        engine.submit("none", ids, SamplingParams())
    with pytest.raises(ValueError, match="ends with an image"):
        engine.submit("last", prompt_ids(model, f"count:{IMAGE_TOKEN}", [png(0)]), SamplingParams(), images=[png(0)])
    text_only = Engine(build_model(len(TOKENIZER), 32, 1, 2, 64), max_batch_size=1, max_context=60, pad_token_id=0)
    with pytest.raises(ValueError, match="reads none"):
        text_only.submit("text", [5, 6], SamplingParams(), images=[png(0)])


def test_the_saved_folder_is_a_transformers_lm_plus_the_encoder(tmp_path):
    model = vision_model()
    model.save_pretrained(tmp_path)
    text_model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(text_model).__name__ == "Qwen2ForCausalLM"
    loaded = load_model(tmp_path)
    ids = torch.tensor([prompt_ids(model, f"{IMAGE_TOKEN}count:", [png(3)])])
    with torch.no_grad():
        before, _ = token_logprobs(model, ids, images=[(png(3),)])
        after, _ = token_logprobs(loaded, ids, images=[(png(3),)])
    assert torch.equal(before, after)
    (tmp_path / "vision.safetensors").write_bytes(b"")  # truncated: the folder check names the file
    with pytest.raises(ValueError, match="vision.safetensors is damaged"):
        load_model(tmp_path)
