"""Shared fixtures: the smallest complete run configuration; and the markers of tests that need an extra."""

from __future__ import annotations


import pytest
from optional_extras import EXTRA_MARKERS, installed


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the default run (-m 'not slow') must leave them out
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A `long` test is a slow one too, whether or not it says so."""
    for item in items:
        if item.get_closest_marker("long") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, packages in EXTRA_MARKERS.items():
        missing = [p for p in packages if not installed(p)]
        if item.get_closest_marker(marker) is not None and missing:
            extra = marker.replace("_", "-")
            pytest.skip(f"needs the {extra} extra ({', '.join(missing)} not installed): pip install -e '.[{extra}]'")


TINY_RUN = [
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "data.arithmetic.num_train=400",
    "data.arithmetic.num_eval=16",
    "sft.steps=20",
    "sft.batch_size=16",
    "rollout.max_batch_size=16",
    "rollout.max_new_tokens=40",
    "scheduler.batch_groups=8",
    "trainer.steps=3",
    "trainer.microbatch_size=4",
    "trainer.checkpoint_every=1",
    "eval.num_prompts=8",
    "eval.k=2",
    "log.progress=false",
    "log.tensorboard=true",
    "verifier.min_workers=1",
    "verifier.max_workers=1",
]
"""Dotted overrides of the default recipe for a run of a few seconds on one core."""

AGENT_RUN = [
    "text_game",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "data.text_game.num_train=200",
    "data.text_game.num_eval=8",
    "sft.steps=20",
    "sft.batch_size=16",
    "rollout.max_batch_size=32",
    "rollout.max_new_tokens=160",
    "env.max_turns=4",
    "scheduler.batch_groups=8",
    "trainer.steps=3",
    "trainer.microbatch_size=8",
    "trainer.checkpoint_every=1",
    "eval.num_prompts=8",
    "eval.k=1",
    "log.progress=false",
    "log.tensorboard=false",
    "verifier.min_workers=1",
    "verifier.max_workers=1",
    "env.max_workers=1",
]
"""The text_game agent recipe (every turn an environment step), small enough for a test."""


@pytest.fixture
def tiny_run() -> list[str]:
    return list(TINY_RUN)


@pytest.fixture
def agent_run() -> list[str]:
    return list(AGENT_RUN)


MIX_RUN = [
    "tasks={sums: {weight: 3, data: {kind: arithmetic, arithmetic: {num_train: 300, num_eval: 8}}},"
    " game: {weight: 1, data: {kind: text_game, text_game: {num_train: 100, num_eval: 8, rooms: 3, distractors: 0}},"
    " env: {kind: text_game, options: {max_steps: 4}, max_turns: 4, reward: env, stop_strings: [\"\\n\"],"
    " max_prompt_tokens: 112, max_workers: 1}, rollout: {max_new_tokens: 160}}}",
    *(o for o in TINY_RUN if not o.startswith(("data.", "eval.", "log.tensorboard"))),
    "model.tiny.max_position_embeddings=320",
    "eval.num_prompts=4",
    "eval.k=1",
    "log.tensorboard=false",
]
"""A mixture of two tasks: arithmetic (single-turn, the math verifier) and the text game (an environment and its
reward), 3:1, small enough for a test."""


@pytest.fixture
def mix_run() -> list[str]:
    return list(MIX_RUN)


VISION_RUN = [
    "vision",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.vision={image_size: 32, patch_size: 8, width: 16, num_layers: 1, num_heads: 2, merge: 1}",
    *(f"tasks.{task}.data.vision.{field}" for task in ("count", "tallest", "most")
      for field in ("num_train=100", "num_eval=8", "image_size=32")),
    *(o for o in TINY_RUN if o.startswith(("sft.", "rollout.max_batch_size", "scheduler.", "trainer.", "eval.",
                                           "log.", "verifier."))),
]
"""The vision recipe (its tiny encoder reads 32x32 pictures as 16 image tokens), small enough for a test."""


@pytest.fixture
def vision_run() -> list[str]:
    return list(VISION_RUN)


VISION_AGENT_RUN = [
    "visual_grid",
    "model.tiny.hidden_size=32",
    "model.tiny.num_layers=1",
    "model.tiny.num_heads=2",
    "model.tiny.vision={image_size: 32, patch_size: 8, width: 16, num_layers: 1, num_heads: 2, merge: 2}",
    "env.options={max_steps: 4, image_size: 32}",
    "env.max_turns=4",
    "env.max_prompt_tokens=32",
    "env.max_workers=1",
    "data.visual_grid.size=4",
    "data.visual_grid.num_train=100",
    "data.visual_grid.num_eval=8",
    "rollout.max_new_tokens=96",
    "trainer.microbatch_size=8",
    "eval.k=1",
    "log.tensorboard=false",
    *(o for o in TINY_RUN if o.startswith(("sft.", "rollout.max_batch_size", "scheduler.", "trainer.steps",
                                           "trainer.checkpoint_every", "eval.num_prompts", "log.progress",
                                           "verifier."))),
]
"""The visual_grid agent recipe (a picture every turn: 32x32, 4 image tokens each), small enough for a test."""


@pytest.fixture
def vision_agent_run() -> list[str]:
    return list(VISION_AGENT_RUN)


MOE_RUN = [*TINY_RUN, "model.tiny.num_experts=4", "precision.trainer=bf16", "precision.rollout=bf16",
           "precision.mode=unified"]
"""The tiny run on a Qwen2-MoE model (routes recorded and replayed) with unified bf16 numerics."""


@pytest.fixture
def moe_run() -> list[str]:
    return list(MOE_RUN)


# A Qwen2.5-style ChatML template (system default, tool responses merged into one user turn, generation prompt).
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first)"
    " or message['role'] == 'assistant' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_CORPUS = (
    "You are a helpful assistant.", "What is 2+3? Answer with a number.", "The answer is 5.", "#### 42",
    "Alla breve is a meter; Allan and Allah are names.", "<tool_response>\nok\n</tool_response>",
    "def add(a, b):\n    return a + b\n", "print(sum(range(10)))", "Let me think step by step.",
)


def build_chat_tokenizer():
    """A real byte-level BPE tokenizer with ChatML special tokens and a Qwen-style chat template, trained
    offline on a tiny corpus: merges, added tokens and template rendering behave as in a Hub checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(list(CHAT_CORPUS) * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def chat_tokenizer():
    return build_chat_tokenizer()


@pytest.fixture
def save_chat_model(chat_tokenizer, tmp_path):
    """save(hidden_size, num_layers) -> a Hugging Face directory: a random Qwen2-style model over the chat
    tokenizer's vocabulary (2 heads, MLP 4x), saved with the tokenizer."""
    from flashreinforce.models import build_model

    def save(hidden_size: int, num_layers: int):
        directory = tmp_path / f"chat-model-{hidden_size}x{num_layers}"
        build_model(len(chat_tokenizer), hidden_size, num_layers, 2, intermediate_size=4 * hidden_size,
                    pad_token_id=chat_tokenizer.pad_token_id,
                    eos_token_id=chat_tokenizer.eos_token_id).save_pretrained(directory)
        chat_tokenizer.save_pretrained(directory)
        return directory
    return save


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of the test module's own on this machine (loopback, usage stats off); a start costs seconds."""
    import os

    ray = pytest.importorskip("ray")

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@pytest.fixture
def one_thread():
    """One torch thread for the test, as a trainer process or rank sets for itself (the same kernels, the same
    rounding on both sides of a comparison); restored after it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
