"""Hugging Face VLM classes as policies (models/hf_vision.py), tiny and built from configs: for each supported family
the engine's behavior log-probs equal the trainer's recompute with images (batched, across pause/resume and a
weight push), image special tokens are never sampled, the image-token count per image is what the forward takes,
the saved folder loads back exactly, and the families the engine cannot run exactly are refused by name."""

import copy
import inspect
import io
import json

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from torch import nn

from flashreinforce.models import token_logprobs
from flashreinforce.models.hf_vision import (
    HFVisionLM,
    check_family,
    image_processor_for,
    is_hf_vision_dir,
    load_hf_vision_lm,
)
from flashreinforce.rollout.engine import Engine, kv_cache_keyword
from engine_rows import max_logprob_gap, recompute, run_to_end
from flashreinforce.types import SamplingParams

IMAGE_ID, VOCAB = 90, 100
FAMILIES = ("llava_clip", "llava_siglip", "idefics3", "smolvlm", "internvl", "qwen2_vl", "qwen2_5_vl")
FIXED = FAMILIES[:5]
"""Families whose images all take the same number of tokens (Qwen2-VL's take as many as their size asks)."""
TOKENS = {"llava_clip": 64, "llava_siglip": 64, "llava_siglip_default": 63, "idefics3": 16, "smolvlm": 16,
          "internvl": 16}
"""64x64 images, 8x8 patches: LLaVA keeps the 8x8 grid (CLIP's class token dropped; SigLIP under "default" loses
a patch), Idefics3 / SmolVLM merge 2x2 (scale_factor 2), InternVL merges 2x2 (downsample_ratio 0.5)."""
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
             patch_size=8)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """The hub out of reach, as on a machine without network: everything here is built from configs or folders."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def text_config(cls: type, **extra) -> dict:
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, **extra).to_dict()


QWEN_TOWERS = {  # 14-pixel patches merged 2x2: one image token per 28x28 pixels
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
}


def vlm_config(family: str):
    if family == "llava_clip":
        return tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**TOWER).to_dict(),
                              text_config=text_config(tf.Qwen2Config), image_token_id=IMAGE_ID)
    if family.startswith("llava_siglip"):  # real SigLIP LLaVAs keep every patch ("full"); "default" drops one
        strategy = "default" if family.endswith("default") else "full"
        return tf.LlavaConfig(vision_config=tf.SiglipVisionConfig(**TOWER).to_dict(),
                              text_config=text_config(tf.Qwen2Config), image_token_id=IMAGE_ID,
                              vision_feature_select_strategy=strategy, vision_feature_layer=-1)
    if family in ("idefics3", "smolvlm"):
        cls = tf.Idefics3Config if family == "idefics3" else tf.SmolVLMConfig
        return cls(vision_config=TOWER, text_config=text_config(tf.LlamaConfig), image_token_id=IMAGE_ID,
                   scale_factor=2)
    if family in QWEN_TOWERS:  # M-RoPE over 16-wide heads: 2 temporal, 3 height and 3 width frequency pairs
        cls, text = (tf.Qwen2VLConfig, tf.Qwen2VLTextConfig) if family == "qwen2_vl" else \
            (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLTextConfig)
        mrope = {"type": "mrope", "mrope_section": [2, 3, 3]}
        return cls(vision_config=QWEN_TOWERS[family], text_config=text_config(text, rope_scaling=mrope),
                   image_token_id=IMAGE_ID, video_token_id=93, vision_start_token_id=94, vision_end_token_id=95)
    assert family == "internvl"
    return tf.InternVLConfig(vision_config=TOWER | dict(image_size=[64, 64], patch_size=[8, 8]),
                             text_config=text_config(tf.Qwen2Config), image_token_id=IMAGE_ID, downsample_ratio=0.5)


def build(family: str, seed: int = 0) -> HFVisionLM:
    """A tiny VLM of the family, weights a function of `seed` only (the global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForImageTextToText.from_config(vlm_config(family), attn_implementation="sdpa")
    return HFVisionLM(model, image_processor_for(model.config))


def png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def size(image: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(image)) as opened:
        return opened.size


def engine_for(model: HFVisionLM, slots: int, eos=1) -> Engine:
    return Engine(copy.deepcopy(model), max_batch_size=slots, max_context=300, eos_token_ids=eos, pad_token_id=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_behavior_logprobs_equal_the_recompute_with_images(family):
    model = build(family)
    engine = engine_for(model, slots=3)
    for i in range(7):  # more requests than slots: images prefill as rows join a running batch
        images = [png(i, (64 + 8 * i, 64))] if i % 3 else [png(i), png(100 + i, (48, 80))]  # not all square
        text = [5, IMAGE_ID, 6, 7] if len(images) == 1 else [5, IMAGE_ID, 8, IMAGE_ID, 9]
        engine.submit(f"r{i}", model.placeholders.expand(text, images), SamplingParams(max_new_tokens=8, seed=i),
                      images=images)
    generations = run_to_end(engine)
    assert len(generations) == 7 and all(g.images and g.token_ids for g in generations)
    assert max_logprob_gap(model, generations) <= 1e-5
    assert not any(IMAGE_ID in g.token_ids for g in generations)
    # The images matter: other pixels give other log-probs.
    other = recompute(model, generations, [tuple(png(999, size(image)) for image in g.images) for g in generations])
    assert float((recompute(model, generations) - other).abs().max()) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_images_survive_pause_resume_and_a_weight_push(family):
    model = build(family)
    engine = engine_for(model, slots=4, eos=())
    for i in range(4):
        engine.submit(f"r{i}", model.placeholders.expand([5, IMAGE_ID, 6], [png(i)]),
                      SamplingParams(max_new_tokens=12, seed=i), images=[png(i)])
    for _ in range(3):
        engine.step()
    partials = engine.pause()
    assert [p.images for p in partials] == [(png(i),) for i in range(4)]
    new = build(family, seed=7)  # the next version's weights, the tower included
    engine.load_weights(new.state_dict(), version=1)
    for partial in partials:  # the prefix brings its images back
        engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)
    generations = run_to_end(engine)
    recomputed = recompute(new, generations)
    for row, g in enumerate(generations):  # the tokens after the resume are version 1's
        start = len(g.prompt_ids)
        late = [j for j, v in enumerate(g.policy_versions) if v == 1]
        assert len(late) == 9
        gap = recomputed[row, [start + j for j in late]] - torch.tensor([g.behavior_logprobs[j] for j in late])
        assert float(gap.abs().max()) <= 1e-5


@pytest.mark.parametrize("family", [*FIXED, "llava_siglip_default"])
def test_tokens_per_image_is_what_the_forward_takes(family):
    model = build(family)
    images = [png(1), png(2)]
    assert model.tokens_per_image(images) == [TOKENS[family]] * 2 == [model.placeholders.tokens_per_image] * 2
    pixels = model.image_inputs(images)["pixel_values"]
    assert tuple(pixels.shape) == ((1, 2, 3, 64, 64) if family in ("idefics3", "smolvlm") else (2, 3, 64, 64))
    ids = torch.tensor([model.placeholders.expand([5, IMAGE_ID, 6, IMAGE_ID, 7], images)])
    with torch.no_grad():
        assert model(input_ids=ids, pixel_values=pixels).logits.shape == (1, ids.shape[1], VOCAB)
        # One image token too many is refused, not read: transformers 5.2x says the counts do not match, 5.20
        # raises ValueError or RuntimeError by family.
        with pytest.raises((ValueError, RuntimeError)):
            model(input_ids=torch.cat([ids[:, :2], ids], 1), pixel_values=pixels)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_positions_are_the_models_own_and_1d_ones_would_differ(family):
    """The recompute (which the engine equals, above) reads an image's tokens at the 3D grid positions the HF model
    computes for itself, and text after it from the grid's largest position on; plain 1D positions read otherwise."""
    model = build(family)
    images = [png(1, (84, 56)), png(2, (56, 112))]  # 3x2 and 2x4 merged patches: 6 and 8 image tokens
    assert model.tokens_per_image(images) == [6, 8]
    ids = torch.tensor([model.placeholders.expand([5, IMAGE_ID, 6, 7, IMAGE_ID, 8, 9, 10], images)])
    positions = model.rope_positions(ids, None, [images])
    assert positions.shape == (3, 1, ids.shape[1])
    # An image advances the position by the longer side of its grid: 1 text + 3 + 2 texts + 4 + 3 texts, the last
    # at 12 (where 1D positions would put it at 18).
    assert positions[:, 0, -1].tolist() == [12] * 3
    inputs = model.image_inputs(images)
    with torch.no_grad():
        ours, _ = token_logprobs(model, ids, images=[images])
        own = model.hf_model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_ID).int(), **inputs).logits
        flat = model.hf_model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], **inputs).logits
    own, flat = (torch.log_softmax(logits[0, :-1].float().index_fill(-1, torch.tensor(IMAGE_ID), -torch.inf), -1)
                 .gather(-1, ids[0, 1:, None])[:, 0] for logits in (own, flat))  # the image token banned, as ours
    text = ids[0, 1:] != IMAGE_ID  # the recompute gives image tokens log-prob 0 (they are banned prompt)
    assert float((ours[0, 1:][text] - own[text]).abs().max()) <= 1e-5
    assert float((own[text] - flat[text]).abs().max()) > 1e-3


def test_qwen_placeholders_render_the_checkpoints_wrapper(tmp_path):
    build("qwen2_vl").save_pretrained(tmp_path)
    added = [{"id": IMAGE_ID, "content": "<|image_pad|>"}, {"id": 93, "content": "<|video_pad|>"},
             {"id": 94, "content": "<|vision_start|>"}, {"id": 95, "content": "<|vision_end|>"}]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    model = load_hf_vision_lm(tmp_path)
    assert model.banned_token_ids == (IMAGE_ID, 93, 94, 95)  # a sampled <|video_pad|> would have no video behind it
    assert model.placeholders.render("<image>Which is larger?") == \
        "<|vision_start|><|image_pad|><|vision_end|>Which is larger?"
    assert type(model.image_processor).__name__ == "Qwen2VLImageProcessorPil"


@pytest.mark.parametrize(("family", "processor"), [
    ("idefics3", lambda: tf.Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 128},
                                                      max_image_size={"longest_edge": 64})),
    ("internvl", lambda: tf.GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}, crop_to_patches=True,
                                                     min_patches=1, max_patches=4)),
])
def test_a_checkpoints_image_splitting_is_turned_off(family, processor):
    """Real SmolVLM / InternVL processors split large images into tiles; each image here is one global image."""
    model = build(family)
    model.image_processor = processor()
    pixels = model.image_inputs([png(0, (128, 128))])["pixel_values"]
    assert tuple(pixels.shape[-4:]) == (1, 3, 64, 64)


def test_pixels_the_model_cannot_read_are_refused():
    model = build("llava_clip")
    model.image_processor = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    with pytest.raises(ValueError, match="reads one 64x64 image: fix the sizes in preprocessor_config.json"):
        model.image_inputs([png(0)])
    model = build("idefics3")  # Idefics3 drops all-zero images as padding: the count would break later
    model.image_processor = tf.Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 64},
                                                         max_image_size={"longest_edge": 64}, image_mean=[0.0] * 3,
                                                         image_std=[1.0] * 3)
    black = io.BytesIO()
    Image.new("RGB", (64, 64)).save(black, format="PNG")
    with pytest.raises(ValueError, match="all-zero pixels"):
        model.image_inputs([png(0), black.getvalue()])


def test_the_wrapper_answers_the_engine_and_trainer_interface():
    model = build("llava_clip")
    assert model.config.vocab_size == VOCAB and model.config._attn_implementation == "sdpa"
    assert set(model.state_dict()) == set(model.hf_model.state_dict())  # HF names: pushes and saves need no renaming
    # the engine hands its KV cache by the name this transformers takes (cache from 5.24, past_key_values before)
    assert kv_cache_keyword(model.language_model) in inspect.signature(model.language_model.forward).parameters
    model.vision.requires_grad_(False)  # the trainer freezes the tower and projector
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in frozen)
    assert model.eval().hf_model.training is False and model.train().hf_model.training is True
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.tensor([model.placeholders.expand([5, IMAGE_ID, 6, 7], [png(0)])])
    logprobs, _ = token_logprobs(model, ids, images=[(png(0),)])
    logprobs.sum().backward()  # gradients reach the LM, not the frozen tower
    assert model.lm_head.weight.grad is not None
    assert all(p.grad is None for p in model.vision.parameters())


@pytest.mark.parametrize("family", ["idefics3", "internvl"])
def test_image_special_tokens_are_never_sampled_and_the_recompute_bans_them_too(family, tmp_path):
    image_token, wrappers, text = {  # each family's image wrapper, written around the placeholder in the text
        "idefics3": ("<image>", ["<fake_token_around_image>", "<global-img>", "<row_1_col_1>"],
                     [5, 91, 92, IMAGE_ID, 91, 6]),
        "internvl": ("<IMG_CONTEXT>", ["<img>", "</img>"], [5, 91, IMAGE_ID, 92, 6]),
    }[family]
    build(family).save_pretrained(tmp_path)
    added = [{"id": IMAGE_ID, "content": image_token}, {"id": 150, "content": wrappers[0]}]  # 150: outside the LM
    added += [{"id": 91 + i, "content": name} for i, name in enumerate(wrappers)]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    model = load_hf_vision_lm(tmp_path)
    banned = (IMAGE_ID, *range(91, 91 + len(wrappers)))
    assert model.banned_token_ids == banned and model.image_token == image_token
    with torch.no_grad():  # make the LM prefer the banned tokens everywhere
        model.lm_head.bias = nn.Parameter(torch.zeros(VOCAB).index_fill(0, torch.tensor(banned), 30.0))
    engine = engine_for(model, slots=4, eos=())
    for i in range(6):
        engine.submit(f"r{i}", model.placeholders.expand(text, [png(i)]), SamplingParams(max_new_tokens=16, seed=i),
                      images=[png(i)])
    generations = run_to_end(engine)
    assert not any(set(banned) & set(g.token_ids) for g in generations)
    assert max_logprob_gap(model, generations) <= 1e-5
    assert bool(torch.isfinite(recompute(model, generations)).all())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_saved_folder_loads_back_exactly(family, tmp_path):
    model = build(family)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert is_hf_vision_dir(tmp_path)
    loaded = load_hf_vision_lm(tmp_path, dtype="float32")
    assert type(loaded.image_processor).__name__.endswith("Pil")
    ids = torch.tensor([model.placeholders.expand([5, IMAGE_ID, 6, IMAGE_ID, 7], [png(3), png(4, (80, 48))])])
    with torch.no_grad():
        before, _ = token_logprobs(model, ids, images=[(png(3), png(4, (80, 48)))])
        after, _ = token_logprobs(loaded, ids, images=[(png(3), png(4, (80, 48)))])
    assert torch.equal(before, after)


def test_save_pretrained_writes_a_given_state_dict(tmp_path):
    model, other = build("internvl"), build("internvl", seed=3)
    model.save_pretrained(tmp_path, state_dict=other.state_dict(), safe_serialization=True)
    loaded = load_hf_vision_lm(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in other.state_dict().items())


@pytest.mark.parametrize(("config", "name", "why"), [
    (tf.Qwen3VLConfig, "qwen3_vl", "M-RoPE"),
    (tf.Ernie4_5_VLMoeConfig, "ernie4_5_vl_moe", "M-RoPE"),
    (tf.Gemma3Config, "gemma3", "bidirectionally"),
    (tf.PaliGemmaConfig, "paligemma", "bidirectionally"),
    (tf.LlavaNextConfig, "llava_next", "not tested; supported: llava, idefics3, smolvlm, internvl"),
])
def test_families_the_engine_cannot_run_exactly_are_refused_by_name(config, name, why, tmp_path):
    config().save_pretrained(tmp_path)
    assert is_hf_vision_dir(tmp_path)
    with pytest.raises(ValueError, match=f"{name}.*{why}"):
        load_hf_vision_lm(tmp_path)


def test_configs_whose_image_count_would_break_are_refused():
    llava = vlm_config("llava_clip")
    llava.vision_config = tf.PixtralVisionConfig()
    with pytest.raises(ValueError, match="llava with a pixtral tower is not tested"):
        check_family(llava)
    internvl = vlm_config("internvl")
    internvl.vision_feature_select_strategy = "full"
    with pytest.raises(ValueError, match="internvl: vision_feature_select_strategy must be 'default'"):
        check_family(internvl)
    idefics3 = vlm_config("idefics3")
    idefics3.scale_factor = 3
    with pytest.raises(ValueError, match="does not split into scale_factor=3"):
        check_family(idefics3)


def test_a_vlm_folder_without_its_image_processor_config_is_a_clear_error(tmp_path):
    build("idefics3").hf_model.save_pretrained(tmp_path)  # the weights without the image processor
    with pytest.raises(ValueError, match="preprocessor_config.json is missing.*image_processor_for"):
        load_hf_vision_lm(tmp_path)


def test_text_only_folders_are_not_vision_dirs(tmp_path):
    tf.Qwen2Config(vocab_size=VOCAB).save_pretrained(tmp_path)
    assert not is_hf_vision_dir(tmp_path)
    assert not is_hf_vision_dir(tmp_path / "absent")
