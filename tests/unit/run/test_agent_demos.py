"""run/agent_demos.py: an agent task's warm start runs the agent itself through the endpoint, its calls answered by
the task's demonstrator, and trains the rows RL would stitch: the template's rendering of the whole conversation,
the demonstrated turns as targets. Against the conftest's byte-level BPE chat tokenizer and the Hermes template."""

import pytest

from flashreinforce.config import load_config
from flashreinforce.data.tool_multiply import operands
from flashreinforce.endpoint.chat import HERMES_TEMPLATE
from flashreinforce.run.agent_demos import agent_examples, agent_template
from flashreinforce.run.data import load_data
from flashreinforce.run.tasks import TASKS

pytestmark = pytest.mark.endpoint

DEMONSTRATE = TASKS["tool_multiply"].demonstrate

AGENT = '''
import json

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]


def conversation(row):
    return [{"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "What is " + row["prompt"].removesuffix("=") + "?"}]


async def run(client, row):
    """A tool loop whose tool evaluates print(a*b) in-process (the recipe's agent runs code in the sandbox)."""
    messages = conversation(row)
    for _ in range(3):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=128)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"answer": message.content}
        for call in message.tool_calls:
            a, b = json.loads(call.function.arguments)["code"].removeprefix("print(").removesuffix(")").split("*")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(int(a) * int(b))})
'''


@pytest.fixture
def agent_config(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "broken.py").write_text("async def run(client, row):\n    raise RuntimeError('no luck')\n")

    def config(*overrides: str):
        return load_config("smollm2_agent", [
            f"env.agent={tmp_path / 'agent.py'}:run", "model.path=unused", "stages.0.steps=1", "sft.batch_size=3",
            "data.tool_multiply.num_train=10", "data.tool_multiply.num_eval=1", "env.max_workers=1",
            "sft.wrong_code_rate=0", "env.max_prompt_tokens=1024",
            "rollout.max_new_tokens=128", *overrides]).stage(0)
    return config


def test_demonstrated_episodes_are_the_template_rendering_of_the_agents_conversation(agent_config, chat_tokenizer):
    tok = chat_tokenizer
    config = agent_config("sft.tool_rate=1")
    train = load_data(config).train

    rows = agent_examples(config, tok, train, DEMONSTRATE, 1024)

    assert len(rows) == config.sft.steps * config.sft.batch_size  # one episode per prompt, one segment each
    tools = [{"type": "function", "function": {"name": "python", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
    for (prompt_ids, completion, mask), item in zip(rows, train):
        a, b = operands(item)
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "python", "arguments": {"code": f"print({a}*{b})"}}}]}
        conversation = [{"role": "system", "content": "Use the tool."},
                        {"role": "user", "content": f"What is {a}*{b}?"}, call, {"role": "tool", "content": str(a * b)},
                        {"role": "assistant", "content": f"answer: {a * b}"}]
        rendered = tok.apply_chat_template(conversation, tools=tools, chat_template=HERMES_TEMPLATE, tokenize=False)
        assert tok.decode([*prompt_ids, *completion]) == rendered.removesuffix("\n")
        assert tok.decode(prompt_ids).endswith("<|im_start|>assistant\n")
        trained = tok.decode([t for t, keep in zip(completion, mask) if keep])
        assert trained == (f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({a}*{b})"}}}}\n'
                           f"</tool_call><|im_end|>answer: {a * b}<|im_end|>")


def test_mental_answers_are_one_call_and_the_warmed_model_keeps_the_template(agent_config, chat_tokenizer):
    config = agent_config("sft.tool_rate=0")
    rows = agent_examples(config, chat_tokenizer, load_data(config).train, DEMONSTRATE, 1024)
    assert all(sum(mask) == len(mask) and chat_tokenizer.decode(completion).startswith("answer: ")
               for _, completion, mask in rows)
    assert agent_template(config) == HERMES_TEMPLATE
    assert agent_template(load_config("smollm2_tool")) is None  # no agent task: the tokenizer's own stays


def test_an_agent_that_fails_every_episode_stops_the_warm_start_with_its_reason(agent_config, chat_tokenizer,
                                                                                 tmp_path):
    config = agent_config(f"env.agent={tmp_path / 'broken.py'}:run")
    with pytest.raises(ValueError, match="no demonstration episode ended well: 3 x agent_error: RuntimeError: no luck"):
        agent_examples(config, chat_tokenizer, load_data(config).train, DEMONSTRATE, 1024)


def test_a_demonstration_the_policy_could_not_sample_is_refused(agent_config, chat_tokenizer):
    config = agent_config("sft.tool_rate=1", "rollout.max_new_tokens=8")
    with pytest.raises(ValueError, match="over its call's budget of 8"):
        agent_examples(config, chat_tokenizer, load_data(config).train, DEMONSTRATE, 1024)


def test_an_agent_task_on_a_kind_without_demonstrations_warm_starts_on_the_kinds_traces(monkeypatch, tiny_run):
    """The default recipe's arithmetic with an agent: SFT on arithmetic's own worked sums, the agent never run."""
    from flashreinforce.metrics.console import Reporter
    from flashreinforce.run import policy as policy_module

    def no_agent(*args, **kwargs):
        raise AssertionError("the agent ran for a data kind without demonstrations")

    monkeypatch.setattr(policy_module, "agent_examples", no_agent)
    config = load_config(None, [*tiny_run, "env.kind=agent", "env.agent=missing.py:run", "sft.steps=1",
                                "sft.batch_size=2"])
    policy = policy_module.tiny_policy(config)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    policy_module.warm_start(config, load_data(config), policy, Reporter(enabled=False))
    assert any(not (before[name] == p).all() for name, p in policy.model.named_parameters())
