"""Chat-message prompts through a real chat-template tokenizer (byte-level BPE, ChatML, built offline)."""

import pytest

from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.types import Prompt

MESSAGES = ({"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+3? Answer with a number."})


def test_chat_messages_render_to_exactly_the_ids_of_the_template(chat_tokenizer):
    prompt = Prompt(id="q", prompt=MESSAGES, ground_truth="5")
    ids = TextEpisodes(chat_tokenizer).prompt_ids(prompt)
    text = chat_tokenizer.apply_chat_template(list(MESSAGES), add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids == chat_tokenizer.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)
    assert chat_tokenizer.decode(ids) == text  # nothing lost on the way, the special tokens included
    im_start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # system, user, and the generation prompt: whole special tokens


def test_a_tokenizer_without_a_chat_template_is_refused_for_chat_prompts(chat_tokenizer):
    plain = chat_tokenizer.__class__(tokenizer_object=chat_tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        TextEpisodes(plain).prompt_ids(Prompt(id="q", prompt=MESSAGES, ground_truth="5"))
