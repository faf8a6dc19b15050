"""Images in multi-turn episodes: observations that show pictures go through the one placeholder contract.

An ImageObservation's placeholders are expanded once, in the forced tokens that bring it into the row (never again
when later turns are rendered); its images ride on the row (Generation.images) after the prompt's, so the engine
reads every picture of the row at each turn's prefill and the trainer's recompute reads the same ones. A bad
observation is its environment's error: checked in the worker, it ends that episode as env_error, counted."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import pickle
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from flashreinforce.controller.episodes import EpisodeBackend, EpisodeSettings, opening_row
from flashreinforce.envs import visual_grid
from flashreinforce.envs.pool import EnvPool
from flashreinforce.envs.protocol import EnvSpec, ImageObservation, check_observation
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.envs.turns import TurnRenderer
from flashreinforce.envs.worker import EnvSessions
from flashreinforce.models import build_char_tokenizer, build_model, token_logprobs
from flashreinforce.models.image_tokens import IMAGE_TOKEN, ImagePlaceholders
from flashreinforce.models.vision import VisionConfig, build_vision_lm
from flashreinforce.rollout.engine import Engine, append_forced_tokens
from flashreinforce.trainer.batching import collate
from flashreinforce.types import Prompt, RolloutKey, SamplingParams, Verdict

TOKENIZER = build_char_tokenizer(visual_grid.ALPHABET, special_tokens=("<pad>", "<eos>", "<unk>", IMAGE_TOKEN))
IMAGE_ID = TOKENIZER.convert_tokens_to_ids(IMAGE_TOKEN)
RUN = 4
"""Image tokens per picture of the tiny encoder below (32x32 pixels, 8x8 patches merged 2x2)."""
PLACEHOLDERS = ImagePlaceholders(IMAGE_ID, RUN)


def png(seed: int, size: int = 32) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def image_runs(ids) -> list[int]:
    """The length of each run of consecutive image tokens in `ids`."""
    runs, length = [], 0
    for token in [*ids, None]:
        if token == IMAGE_ID:
            length += 1
        elif length:
            runs, length = [*runs, length], 0
    return runs


# ---- the observation check (in the worker) ----------------------------------------------------------------


def test_an_observation_needs_one_placeholder_per_image_and_images_that_decode():
    check_observation(ImageObservation(f"{IMAGE_TOKEN}a{IMAGE_TOKEN}b", (png(0), png(1))), "env 'x' turn 1")
    check_observation(ImageObservation([{"role": "user", "content": f"{IMAGE_TOKEN}look"}], (png(0),)), "w")
    check_observation("plain text", "env 'x' turn 1")
    with pytest.raises(ValueError, match=r"env 'x' turn 2: the observation has 1 <image> placeholder\(s\) for 2"):
        check_observation(ImageObservation(f"{IMAGE_TOKEN}two?", (png(0), png(1))), "env 'x' turn 2")
    with pytest.raises(ValueError, match="has 0 <image> placeholder.* for 1 image"):
        check_observation(ImageObservation("no place", (png(0),)), "env 'x' turn 1")
    with pytest.raises(ValueError, match="has 1 <image> placeholder.* for 0 image"):  # a placeholder, no image
        check_observation(f"see {IMAGE_TOKEN}", "env 'x' reset")
    with pytest.raises(ValueError, match="has 2 <image> placeholder"):  # messages count over their contents
        check_observation(ImageObservation([{"role": "user", "content": IMAGE_TOKEN}] * 2, (png(0),)), "w")
    with pytest.raises(ValueError, match="image 0: 9 bytes that do not decode"):
        check_observation(ImageObservation(IMAGE_TOKEN, (b"not a png",)), "w")
    with pytest.raises(TypeError, match="image 0 is a str; give the encoded bytes"):
        check_observation(ImageObservation(IMAGE_TOKEN, ("picture.png",)), "w")


BAD_ENVS = textwrap.dedent('''
    from flashreinforce.envs.protocol import ImageObservation
    from flashreinforce.envs.visual_grid import VisualGridEnv


    class MissingPicture(VisualGridEnv):
        """Forgets the picture of its second observation (the placeholder stays)."""

        def step(self, action):
            result = super().step(action)
            if self._turn == 2 and not result.done:
                result = result._replace(observation=ImageObservation(result.observation.text, ()))
            return result
''')


@pytest.fixture(scope="module")
def bad_env(tmp_path_factory) -> EnvSpec:
    directory = tmp_path_factory.mktemp("envs")
    (directory / "bad_env.py").write_text(BAD_ENVS)
    return EnvSpec(kind="bad_env.py:MissingPicture", options={"max_steps": 6, "image_size": 32},
                   base_dir=str(directory))


def grid_prompt(i: int = 0) -> Prompt:
    return visual_grid.visual_grid_prompts(i + 1, split="train", seed=7)[i]


def test_the_worker_reports_a_bad_observation_as_its_environments_error_naming_the_turn(bad_env):
    sessions = EnvSessions(bad_env)
    ok, first = sessions.handle(("open", "s", grid_prompt(), 0, ()))
    assert ok == "ok" and len(first.images) == 1
    assert sessions.handle(("step", "s", "nothing"))[0] == "ok"  # turn 1: an invalid move, still a picture
    kind, message = sessions.handle(("step", "s", "nothing"))
    assert kind == "error" and "env 'bad_env.py:MissingPicture' turn 2" in message
    assert "1 <image> placeholder(s) for 0 image(s)" in message
    assert "s" not in sessions.envs  # the session is closed, as after a raise


# ---- rendering: each placeholder expanded once, where it enters the row ----------------------------------


def test_first_prompt_and_observations_expand_their_own_placeholders_once():
    renderer = TurnRenderer(TOKENIZER, images=PLACEHOLDERS)
    prompt = Prompt("p", f"{IMAGE_TOKEN}reach the goal.", "", images=(png(0),))
    ids, _ = renderer.first_prompt(prompt, ImageObservation(f"{IMAGE_TOKEN}move:", (png(1),)))
    assert ids == PLACEHOLDERS.expand(encode(f"{IMAGE_TOKEN}reach the goal.\n{IMAGE_TOKEN}move:\n"), [png(0), png(1)])
    assert image_runs(ids) == [RUN, RUN]
    row = list(ids)
    for turn in range(3):  # each observation's ids hold its own picture's run, and nothing earlier again
        forced, _ = renderer.observation_ids(None, encode("up\n"), ImageObservation(f"wall.\n{IMAGE_TOKEN}move:",
                                                                                  (png(2 + turn),)))
        assert forced == [*encode("wall.\n"), *[IMAGE_ID] * RUN, *encode("move:\n")]
        row += [*encode("up\n"), *forced]
    assert image_runs(row) == [RUN] * 5
    with pytest.raises(ValueError, match="expanded already"):  # expanding the row again is refused
        PLACEHOLDERS.expand(row, [png(k) for k in range(5)])


def test_an_observation_with_pictures_is_never_cut_and_a_text_model_refuses_it():
    renderer = TurnRenderer(TOKENIZER, images=PLACEHOLDERS, max_observation_chars=16)
    long = "a" * 40 + IMAGE_TOKEN + "move:"
    forced, _ = renderer.observation_ids(None, [], ImageObservation(long, (png(0),)))
    assert image_runs(forced) == [RUN] and len(forced) == 40 + RUN + len("move:\n")  # a cut would lose the place
    with pytest.raises(ValueError, match="an observation has 1 images but the model reads none: set model.tiny"):
        TurnRenderer(TOKENIZER).observation_ids(None, [], ImageObservation(IMAGE_TOKEN, (png(0),)))


def test_a_chat_conversation_keeps_placeholders_as_text_and_expands_only_the_new_message(chat_tokenizer):
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    placeholders = ImagePlaceholders(image_id, 3)
    renderer = TurnRenderer(tokenizer, images=placeholders)
    prompt = Prompt("p", ({"role": "user", "content": "Reach the goal."},), "")
    ids, conversation = renderer.first_prompt(prompt, ImageObservation(f"{IMAGE_TOKEN}Move:", (png(0),)))
    assert ids.count(image_id) == 3 and conversation[-1]["content"].count(IMAGE_TOKEN) == 1
    sampled = [*tokenizer.encode("up", add_special_tokens=False), tokenizer.eos_token_id]
    for turn in range(2):  # the history (with its earlier placeholders) is re-rendered, never re-expanded
        forced, conversation = renderer.observation_ids(conversation, sampled,
                                                        ImageObservation(f"{IMAGE_TOKEN}Move:", (png(1 + turn),)))
        assert forced.count(image_id) == 3
        assert sum(m["content"].count(IMAGE_TOKEN) for m in conversation) == 2 + turn


# ---- the engine: images among a prefix's forced tokens ----------------------------------------------------


def grid_policy(seed: int = 0):
    lm = build_model(len(TOKENIZER), 32, 1, 2, 256, pad_token_id=TOKENIZER.pad_token_id,
                     eos_token_id=TOKENIZER.eos_token_id, seed=seed)
    vision = VisionConfig(image_size=32, patch_size=8, width=16, num_layers=1, num_heads=2, merge=2,
                          image_token_id=IMAGE_ID)
    model = build_vision_lm(lm, vision, seed=seed)
    assert model.placeholders == PLACEHOLDERS
    return model


def test_the_engine_counts_image_tokens_of_the_prefix_and_refuses_a_row_ending_with_one():
    model = grid_policy()
    engine = Engine(copy.deepcopy(model), max_batch_size=2, max_context=120, eos_token_ids=(), pad_token_id=0)
    prompt = PLACEHOLDERS.expand(encode(f"{IMAGE_TOKEN}move:\n"), [png(0)])
    params = SamplingParams(max_new_tokens=40, seed=1)
    observation = PLACEHOLDERS.expand(encode(f"{IMAGE_TOKEN}move:\n"), [png(1)])
    row = append_forced_tokens(opening_row("r", prompt, params), [*encode("up\n"), *observation])
    with pytest.raises(ValueError, match="prompt_ids and prefix tokens hold 8 image tokens, its 1 images need 4"):
        engine.submit("r", prompt, params, prefix=dataclasses.replace(row, images=(png(0),)))
    ending = append_forced_tokens(opening_row("r", prompt, params), PLACEHOLDERS.expand([IMAGE_ID], [png(1)]))
    with pytest.raises(ValueError, match=r"the prompt \(or its prefix\) ends with an image"):
        engine.submit("r", prompt, params, prefix=dataclasses.replace(ending, images=(png(0), png(1))))
    engine.submit("r", prompt, params, prefix=dataclasses.replace(row, images=(png(0), png(1))))
    while engine.has_work:
        done = engine.step()
    assert done[0].images == (png(0), png(1)) and len(done[0].token_ids) > len(row.token_ids)


# ---- episodes: the engine's behavior log-probs are the trainer's recompute, pictures and all -----------------


class EngineBackend:
    """The part of the Backend protocol EpisodeBackend uses, over an Engine stepped on the event loop's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def free_slots(self) -> int:
        return self.engine.max_batch_size

    @property
    def in_flight(self) -> int:
        return int(self.engine.has_work)

    def submit(self, rid, prompt_ids, params, prefix=None):
        self.engine.submit(rid, prompt_ids, params, prefix=prefix)

    async def finished(self):
        while True:
            done = self.engine.step()
            if done:
                return done
            await asyncio.sleep(0)

    async def pause(self):
        return self.engine.pause(), []

    async def resume(self, partials):
        for partial in partials:
            self.engine.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)

    async def score(self, items):
        return [Verdict(0.0, False, "wrong") for _ in items]

    def stats(self):
        return {}

    async def close(self):
        pass


def episodes_over(engine: Engine, pool: EnvPool) -> EpisodeBackend:
    return EpisodeBackend(EngineBackend(engine), TextEpisodes(TOKENIZER, PLACEHOLDERS), pool=pool,
                          settings=EpisodeSettings(max_turns=4, reward="env", lockstep=True))


PARAMS = [SamplingParams(max_new_tokens=120, seed=i, stop_strings=("\n",)) for i in range(4)]
PROMPTS = visual_grid.visual_grid_prompts(4, split="train", seed=7)


async def play(model, spec: EnvSpec, *, pause: bool = False) -> tuple[dict, dict[str, float]]:
    """Four episodes of `spec` to their end, and the episodes' stats. With `pause`: paused once the first
    episodes end, the partials through a pickle as a checkpoint holds them, and resumed by a fresh engine, pool
    and EpisodeBackend, as `--resume` does (the environments replay their actions)."""

    async def start():
        engine = Engine(copy.deepcopy(model), max_batch_size=4, max_context=256, pad_token_id=TOKENIZER.pad_token_id,
                        eos_token_ids=TOKENIZER.eos_token_id, tokenizer=TOKENIZER)
        pool = EnvPool(spec, step_timeout_s=30, max_workers=1)
        await pool.start()
        return episodes_over(engine, pool), pool

    episodes, pool = await start()
    try:
        for i, prompt in enumerate(PROMPTS):
            episodes.start(f"r{i}", prompt, PARAMS[i])
        done = await asyncio.wait_for(episodes.finished(), 60)
        if pause:
            partials, ended = await episodes.pause()
            assert partials and all(p.images for p in partials)
            partials = pickle.loads(pickle.dumps([*partials]))  # what a checkpoint keeps of them
            await episodes.close()
            await pool.aclose()
            episodes, pool = await start()
            done += ended
            for partial in partials:
                episodes.restore(partial.request_id, PROMPTS[int(partial.request_id[1:])], partial.params)
            await episodes.resume(partials)
        while len(done) < len(PROMPTS):
            done += await asyncio.wait_for(episodes.finished(), 60)
        return {g.request_id: g for g in done}, episodes.stats()
    finally:
        await pool.aclose()


GRID = EnvSpec(kind="visual_grid", options={"max_steps": 4, "image_size": 32})


def trainer_batch(generations):
    """The rows as the loop hands them to the trainer: trajectories (their pictures with them), collated."""
    prompts = {f"r{i}": prompt for i, prompt in enumerate(PROMPTS)}
    return collate([to_trajectory(RolloutKey(g.request_id, 0), prompts[g.request_id], 0, g, Verdict(0.0, False))
                    for g in generations], pad_token_id=TOKENIZER.pad_token_id)


def trainer_gap(model, generations, images=None) -> float:
    """Largest |behavior - recomputed| log-prob over the sampled tokens, the recompute reading the batch's
    pictures (or `images`, one tuple per row)."""
    batch = trainer_batch(generations)
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                       images=batch.images if images is None else images)
    return float((recomputed - batch.behavior_logprobs).masked_fill(~batch.loss_mask, 0.0).abs().max())


def test_a_multi_turn_episode_with_pictures_has_the_engines_logprobs_in_the_trainers_recompute():
    model = grid_policy()
    rows, _ = asyncio.run(play(model, GRID))
    generations = sorted(rows.values(), key=lambda g: g.request_id)
    assert max(len(g.images) for g in generations) >= 2  # some episode saw the picture after a move
    for g, prompt in zip(generations, PROMPTS):
        layout = visual_grid.layout_of(prompt)
        assert g.images[0] == visual_grid.draw_grid(layout, layout.start, 32)  # the reset's picture first
        assert image_runs([*g.prompt_ids, *g.token_ids]) == [RUN] * len(g.images)  # one run per picture, in order
        assert all(t != IMAGE_ID for t, m in zip(g.token_ids, g.loss_mask) if m)  # never sampled
    assert trainer_batch(generations).images == tuple(g.images for g in generations)
    assert trainer_gap(model, generations) <= 1e-5
    # the pictures matter: each observation's own, not only the first one
    others = [(*g.images[:1], *[png(99)] * (len(g.images) - 1)) for g in generations]
    assert trainer_gap(model, generations, others) > 1e-4


def test_episodes_paused_mid_way_keep_their_pictures_through_a_checkpoint_and_end_as_uninterrupted():
    model = grid_policy()
    straight, _ = asyncio.run(play(model, GRID))
    resumed, _ = asyncio.run(play(model, GRID, pause=True))
    for rid, g in straight.items():
        r = resumed[rid]
        assert (r.token_ids, r.images, r.episode.actions) == (g.token_ids, g.images, g.episode.actions)
        assert max(abs(a - b) for a, b in zip(r.behavior_logprobs, g.behavior_logprobs)) <= 1e-5
    assert trainer_gap(model, list(resumed.values())) <= 1e-5


def test_a_missing_picture_ends_only_its_episode_as_a_counted_env_error(bad_env):
    rows, stats = asyncio.run(play(grid_policy(), bad_env))
    failed = [g for g in rows.values() if g.finish_reason == "env_error"]
    assert failed and stats["env/env_error"] == stats["episode/end/env_error"] == len(failed)
    for g in failed:  # the second step's observation lost its picture
        assert len(g.episode.actions) == 1 and "env 'bad_env.py:MissingPicture' turn 2: the observation has 1 " \
            "<image> placeholder(s) for 0 image(s)" in g.episode.end
        assert image_runs([*g.prompt_ids, *g.token_ids]) == [RUN] * len(g.images)  # the row so far is whole
    for g in rows.values():  # the others never stepped a second time (or reached the goal there)
        assert g in failed or len(g.episode.actions) < 2 or g.episode.end == "done"
