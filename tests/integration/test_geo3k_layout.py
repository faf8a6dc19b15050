"""A parquet in verl's geometry3k layout (chat prompts with `<image>`, images as `{"bytes": ...}`) trains with
data.kind=files from a model folder: the tiny vision policy and a tiny Qwen2-VL built from its config (3D M-RoPE
positions, dynamic resolution). Each run's engine and trainer describe the same distribution (the behavior vs
recompute gap in metrics.jsonl stays at float rounding), and each sample's prompt holds the model's own image
wrapper."""

import io
import json

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from conftest import build_chat_tokenizer
from flashreinforce.config import load_config
from flashreinforce.models import build_model
from flashreinforce.models.hf_vision import image_processor_for
from flashreinforce.models.vision import VisionConfig, build_vision_lm
from flashreinforce.run.training import run_training

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
QWEN_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


def picture(colour: str, seed: int, size: tuple[int, int]) -> bytes:
    """A square of the colour on noise: what the answer depends on is only in the image."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 60, (size[1], size[0], 3), dtype=np.uint8)
    pixels[size[1] // 4: 3 * size[1] // 4, size[0] // 4: 3 * size[0] // 4] = COLOURS[colour]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_geo3k_parquet(path, rows: int = 16) -> None:
    """Column for column what verl's examples/data_preprocess/geo3k.py writes (sizes vary, as real figures do)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    colours = list(COLOURS)
    table = [{"data_source": "hiyouga/geometry3k",
              "prompt": [{"role": "user", "content": "<image>What colour is the square? Answer in one word."}],
              "images": [{"bytes": picture(colours[i % 3], i, (56 + 8 * (i % 3), 56)), "path": None}],
              "ability": "math",
              "reward_model": {"ground_truth": colours[i % 3], "style": "rule"},
              "extra_info": {"index": i, "split": "train"}} for i in range(rows)]
    pq.write_table(pa.Table.from_pylist(table), path)


def tiny_vision_folder(path) -> None:
    tokenizer = build_chat_tokenizer()
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    language_model = build_model(len(tokenizer), 32, 1, 2, 256, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    vision = VisionConfig(image_size=64, patch_size=16, width=32, num_layers=1, num_heads=2, merge=2,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    build_vision_lm(language_model, vision).save_pretrained(path)
    tokenizer.save_pretrained(path)


def tiny_qwen2_vl_folder(path) -> None:
    tokenizer = build_chat_tokenizer()
    tokenizer.add_tokens(QWEN_TOKENS, special_tokens=True)
    image, video, start, end = tokenizer.convert_tokens_to_ids(QWEN_TOKENS)
    text = tf.Qwen2VLTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    config = tf.Qwen2VLConfig(text_config=text.to_dict(), image_token_id=image, video_token_id=video,
                              vision_start_token_id=start, vision_end_token_id=end,
                              vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
    torch.manual_seed(0)
    tf.AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").save_pretrained(path)
    image_processor_for(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize(("make_folder", "wrapper"), [
    (tiny_vision_folder, "<image>"),
    (tiny_qwen2_vl_folder, "<|vision_start|><|image_pad|>"),
])
def test_a_geo3k_layout_parquet_trains_from_a_vlm_folder(make_folder, wrapper, tiny_run, tmp_path):
    model_dir, data = tmp_path / "model", tmp_path / "geo3k.parquet"
    make_folder(model_dir)
    write_geo3k_parquet(data)
    config = load_config(None, [*tiny_run, f"model.path={model_dir}", "data.kind=files", f"data.train={data}",
                                f"data.eval={data}", "verifier.reward_fn=exact", "scheduler.batch_groups=8",
                                "trainer.steps=2", "rollout.max_new_tokens=6", "eval.num_prompts=4",
                                "log.tensorboard=false"])
    summary = run_training(config, run_dir=tmp_path / "run")
    assert summary["optimizer_steps"] == 2 and summary["trained_trajectories"] == 16
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert len(trained) == 2
    # Behavior log-probs (engine) against the trainer's recompute of the same tokens before the update.
    assert max(r["mismatch/abs_logprob_diff"] for r in trained) <= 1e-4
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(wrapper in sample["prompt"] for sample in samples)
